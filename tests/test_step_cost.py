"""The step-cost model (jaxsched/core/step_cost.py): fits, drift, unobserved pairs, monotonicity in T,
exact round trips through JSON, determinism, the error report and bad input. Synthetic timings only."""

from __future__ import annotations

import json
import math

import pytest

from jaxsched.core.buckets import bucket_pairs, seq_buckets, token_buckets
from jaxsched.core.step_cost import StepCostModel, StepShape

PAIRS = bucket_pairs(token_buckets(512, 64), seq_buckets(64))


def cost(T: int, S: int) -> tuple[float, float]:
    """Synthetic (a seconds, b seconds per context token) of a pair, increasing in T and S."""
    return 1e-3 + 4e-6 * T + 2e-5 * S, 3e-8 * (1 + S / 64)


def noise(i: int) -> float:
    return 1 + 0.003 * math.sin(1.7 * i)  # deterministic, within +-0.3 %


def feed(model: StepCostModel, pairs, n: int = 60, scale: float = 1.0, noisy: bool = False) -> None:
    for i in range(n):
        for T, S in pairs:
            a, b = cost(T, S)
            x = S * (1 + (37 * i) % 2048)  # deterministic contexts of S rows, S to S * 2048 tokens
            model.observe(StepShape(T, S, x), scale * (a + b * x) * (noise(i) if noisy else 1.0))


def line(model: StepCostModel, T: int, S: int) -> tuple[float, float]:
    """(a, b) as predicted: the value at context 0 and the slope up to a large context."""
    x = S * 4096
    a = model.predict(StepShape(T, S, 0))
    return a, (model.predict(StepShape(T, S, x)) - a) / x


@pytest.mark.parametrize("noisy", [False, True])
def test_recovers_a_and_b_per_pair(noisy):
    model = StepCostModel(PAIRS)
    feed(model, PAIRS, noisy=noisy)
    for T, S in PAIRS:
        a, b = line(model, T, S)
        want_a, want_b = cost(T, S)
        tol = 1e-9 if not noisy else 1e-2
        assert a == pytest.approx(want_a, rel=tol) and b == pytest.approx(want_b, rel=tol), (T, S)
        assert model.known(T, S)


def test_a_seed_is_weak_and_makes_a_pair_known():
    model = StepCostModel(PAIRS)
    assert not model.known(64, 8)
    model.seed(64, 8, 2 * sum(cost(64, 8)))  # twice the real cost
    assert model.known(64, 8) and model.predict(StepShape(64, 8, 8)) == pytest.approx(2 * sum(cost(64, 8)))
    feed(model, [(64, 8)], n=200)
    a, b = line(model, 64, 8)
    assert a == pytest.approx(cost(64, 8)[0], rel=1e-2) and b == pytest.approx(cost(64, 8)[1], rel=1e-2)


def test_a_pair_with_one_context_takes_the_pooled_slope():
    model = StepCostModel(PAIRS)
    feed(model, [(64, 8), (128, 8)])
    for _ in range(5):
        model.observe(StepShape(32, 8, 800), 0.01)
    assert model.predict(StepShape(32, 8, 800)) == pytest.approx(0.01)
    _, b = line(model, 32, 8)
    assert b == pytest.approx(cost(64, 8)[1], rel=1e-6)


@pytest.mark.parametrize("forgetting, follows", [(0.98, True), (1.0, False)])
def test_tracks_drift(forgetting, follows):
    """After the cost doubles, predictions are within 5 % of it after 150 observations; without
    forgetting they are not (the old half of the data still counts fully)."""
    pair = [(256, 32)]
    model = StepCostModel(PAIRS, forgetting=forgetting)
    feed(model, pair, n=500)
    feed(model, pair, n=150, scale=2.0)
    a, b = cost(256, 32)
    x = 32 * 1000
    err = abs(model.predict(StepShape(256, 32, x)) / (2 * (a + b * x)) - 1)
    assert (err < 0.05) == follows, err


def test_unobserved_pairs_are_predicted_from_observed_ones():
    observed = [p for i, p in enumerate(PAIRS) if i % 3 != 1]
    missing = [p for p in PAIRS if p not in observed]
    model = StepCostModel(PAIRS)
    feed(model, observed)
    for T, S in missing:
        assert not model.known(T, S)
        a, b = line(model, T, S)
        want_a, want_b = cost(T, S)
        # a is linear in T and S, so the global fit is exact; b is the pooled slope
        assert a == pytest.approx(want_a, rel=1e-6), (T, S)
        assert b == pytest.approx(want_b, rel=0.5), (T, S)


def test_one_observed_pair_predicts_every_pair():
    model = StepCostModel(PAIRS)
    feed(model, [(128, 16)])
    assert model.predict(StepShape(16, 8, 100)) == pytest.approx(sum(m * v for m, v in zip((1, 100), cost(128, 16))))


def assert_monotone_in_T(model: StepCostModel) -> None:
    for S in sorted({s for _, s in PAIRS}):
        ts = sorted(t for t, s in PAIRS if s == S)
        for x in (0, S * 10, S * 3000):
            preds = [model.predict(StepShape(t, S, x)) for t in ts]
            assert preds == sorted(preds), (S, x, preds)


def test_predictions_are_monotone_in_T_even_when_the_data_is_not():
    model = StepCostModel(PAIRS)
    feed(model, [p for i, p in enumerate(PAIRS) if i % 2 == 0])
    # a small bucket measured slower than the larger ones around it (a noisy host, a slow warm-up)
    for i in range(50):
        model.observe(StepShape(32, 8, 8 * (1 + i)), 0.05 + 1e-6 * i)
    assert_monotone_in_T(model)
    assert model.predict(StepShape(512, 8, 80)) >= model.predict(StepShape(32, 8, 80)) > 0.02
    assert_monotone_in_T(StepCostModel(PAIRS))  # no data: all 0.0
    assert StepCostModel(PAIRS).predict(StepShape(64, 8, 100)) == 0.0


def test_table_round_trip_through_json_is_exact():
    model = StepCostModel(PAIRS, forgetting=0.97)
    model.seed(16, 8, 1e-3)
    feed(model, PAIRS[::2], noisy=True)
    again = StepCostModel.from_table(json.loads(json.dumps(model.to_table())))
    shapes = [StepShape(t, s, x) for t, s in PAIRS for x in (0, 7 * s, 1234 * s)]
    assert [again.predict(sh) for sh in shapes] == [model.predict(sh) for sh in shapes]
    assert all(again.known(t, s) == model.known(t, s) for t, s in PAIRS)
    # the state, not only the fit, round trips: both keep learning identically
    feed(model, PAIRS[1::2], n=10)
    feed(again, PAIRS[1::2], n=10)
    assert again.to_table() == model.to_table()
    assert [again.predict(sh) for sh in shapes] == [model.predict(sh) for sh in shapes]


def test_same_observations_give_identical_predictions():
    one, two = StepCostModel(PAIRS), StepCostModel(PAIRS)
    for m in (one, two):
        m.seed(64, 32, 2e-3)
        feed(m, PAIRS[3:], noisy=True)
    assert one.to_table() == two.to_table()
    assert all(one.predict(StepShape(t, s, 99 * s)) == two.predict(StepShape(t, s, 99 * s)) for t, s in PAIRS)


def test_error_report_on_a_known_case():
    model = StepCostModel(PAIRS)
    feed(model, PAIRS, n=20)
    shapes = [StepShape(t, s, 50 * s) for t, s in PAIRS]
    report = model.error_report([(sh, model.predict(sh) / 1.1) for sh in shapes])  # every prediction 10 % high
    assert report["count"] == len(shapes)
    for key in ("mean", "p50", "p90", "p99", "max"):
        assert report[key] == pytest.approx(0.1), key
    assert report["within_15"] == 1.0
    mixed = [(shapes[0], model.predict(shapes[0]) / 1.1), (shapes[1], model.predict(shapes[1]) / 1.3)]
    report = model.error_report(mixed)
    assert report["max"] == pytest.approx(0.3) and report["mean"] == pytest.approx(0.2)
    assert report["within_15"] == 0.5
    json.dumps(report)
    assert model.error_report([])["count"] == 0


def test_bad_input_raises():
    model = StepCostModel(PAIRS)
    with pytest.raises(ValueError, match="finite number of seconds >= 0"):
        model.observe(StepShape(64, 8, 100), -1e-3)
    with pytest.raises(ValueError, match="finite number of seconds"):
        model.observe(StepShape(64, 8, 100), float("nan"))
    with pytest.raises(ValueError, match=r"\(T=64, S=7\) is not a compiled bucket pair"):
        model.observe(StepShape(64, 7, 100), 1e-3)
    with pytest.raises(ValueError, match="not a compiled bucket pair"):
        model.seed(3, 8, 1e-3)
    with pytest.raises(ValueError, match="not a compiled bucket pair"):
        model.predict(StepShape(64, 7, 100))
    with pytest.raises(ValueError, match="context must be >= 0"):
        model.observe(StepShape(64, 8, -1), 1e-3)
    with pytest.raises(ValueError, match="forgetting must be in"):
        StepCostModel(PAIRS, forgetting=0.0)
    with pytest.raises(ValueError, match="got none"):
        StepCostModel([])
    with pytest.raises(ValueError, match="measured times > 0"):
        model.error_report([(StepShape(64, 8, 100), 0.0)])
    with pytest.raises(ValueError, match="table version"):
        StepCostModel.from_table({"version": 0, "forgetting": 0.98, "pairs": []})
    assert not model.known(64, 7)  # a bad observation left nothing behind
    assert not model.known(64, 8)


def test_widths_are_fitted_apart_and_kept_in_the_table():
    """Speculative steps (width Q: each row's logits at Q positions) cost more than the same (T, S)
    at width 1; each width has its own lines, and the table keeps them (version 1 tables read as
    width 1)."""
    model = StepCostModel(PAIRS, widths=(1, 4))
    for ctx in (100, 400, 900):
        model.observe(StepShape(64, 8, ctx), 1e-3 + 1e-6 * ctx)
        model.observe(StepShape(64, 8, ctx, 4), 2e-3 + 1e-6 * ctx)
    assert model.predict(StepShape(64, 8, 500)) == pytest.approx(1.5e-3)
    assert model.predict(StepShape(64, 8, 500, 4)) == pytest.approx(2.5e-3)
    assert model.known(64, 8, 4) and not model.known(64, 16, 4)
    with pytest.raises(ValueError, match="at width 3"):
        model.predict(StepShape(64, 8, 0, 3))
    again = StepCostModel.from_table(json.loads(json.dumps(model.to_table())))
    assert again.predict(StepShape(64, 8, 500, 4)) == model.predict(StepShape(64, 8, 500, 4))
    old = {"version": 1, "forgetting": 0.98, "pairs": [[t, s, 0, 0, 0, 0, 0] for t, s in PAIRS]}
    assert StepCostModel.from_table(old).widths == [1]
