"""The sampler's variants without lax.cond (sampler.sample's `features`; a GPU engine's host picks one per
step, the platform record's sampler_branches): each gives the cond program's outputs for every step it covers,
`needs` names what a step needs, a variant that lacks a needed part gives other outputs, and no
variant holds a cond (which XLA:GPU would turn into a wait for the device)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsched.runner.batch import BatchDescriptor, flat_sizes
from jaxsched.runner.sampler import ADJUST, FEATURES, FILTER, LOGPROBS, SAMPLE, SamplerOutput, needs, sample
from jaxsched.structured.grammar import mask_words
from pallas_kernels import tuning

S, V, W, LB, K = 16, 700, 8, 4, 3  # V over 512 and not a multiple of it: both argmax levels, a padded block


def _batch(**fields) -> BatchDescriptor:
    ni, nf = flat_sizes(16, S)
    b = BatchDescriptor.from_flat(np.zeros(ni, np.int32), np.zeros(nf, np.float32), 16, S,
                                  np.zeros((S, W), np.int32), np.zeros((S, W), np.float32),
                                  np.full((S, mask_words(V)), -1, np.int32), np.full((S, LB), V, np.int32),
                                  np.zeros((S, LB), np.float32))
    b.top_p[:] = 1.0
    b.num_logprobs[:] = -1
    b.seeds[:] = np.arange(S) * 7 + 1
    b.sample_index[:] = 3
    for k, v in fields.items():
        getattr(b, k)[:] = v
    return b


def _scenario(parts: tuple[str, ...], logits: np.ndarray) -> tuple[BatchDescriptor, bool]:
    """A batch where each named part changes some row's outputs; and whether a row has penalties,
    a logit_bias or a mask (the runner's has_penalties / has_bias / has_mask)."""
    b = _batch()
    top = logits.argmax(-1)
    adjusted = False
    if "sample" in parts:
        b.temperature[:8] = 1.0
    if "filter" in parts:  # top_k 1 keeps the argmax, where an unfiltered draw rarely lands; top_p 0.9 many
        b.temperature[8:12] = [1.0, 1.0, 3.0, 3.0]
        b.top_k[8:10] = 1
        b.top_p[10:12] = 0.9
    if "logprobs" in parts:
        b.num_logprobs[[1, 12]] = [2, 0]
    if "penalties" in parts:  # a presence penalty of 100 on row 13's argmax, repetition on row 14's
        b.penalty_num[13:15] = 1
        b.penalty_ids[13:15, 0] = top[13:15]
        b.penalty_counts[13:15, 0] = 1.0
        b.presence_penalty[13] = 100.0
        b.repetition_penalty[13:15] = [1.0, 1e4]
        adjusted = True
    if "bias" in parts:  # -100 on row 15's argmax
        b.bias_ids[15, 0] = top[15]
        b.bias_values[15, 0] = -100.0
        adjusted = True
    if "mask" in parts:  # row 12 may take token 5 only; the others' masks stay all ones (as the packer leaves them)
        b.token_mask[12] = 0
        b.token_mask[12, 0] = 1 << 5
        b.masked[12] = 1
        adjusted = True
    return b, adjusted


@functools.partial(jax.jit, static_argnames=("features",))
def _sample(logits, fi, ff, pen_ids, pen_counts, mask, bias_ids, bias_values, features):
    b = BatchDescriptor.from_flat(fi, ff, 16, S, pen_ids, pen_counts, mask, bias_ids, bias_values)
    return sample(logits, b, K, features)


def _args(logits, b):
    return (jnp.asarray(logits), b.flat_i32, b.flat_f32, b.penalty_ids, b.penalty_counts, b.token_mask, b.bias_ids,
            b.bias_values)


def _run(logits, b, features) -> SamplerOutput:
    ints, floats = _sample(*_args(logits, b), features=features)
    return SamplerOutput.unpack(np.asarray(ints), np.asarray(floats), S, K)


SCENARIOS = {
    (): frozenset(),
    ("sample",): {SAMPLE},
    ("sample", "filter"): {SAMPLE, FILTER},
    ("filter",): {SAMPLE, FILTER},
    ("logprobs",): {LOGPROBS},
    ("sample", "logprobs"): {SAMPLE, LOGPROBS},
    ("penalties",): {ADJUST},
    ("bias",): {ADJUST},
    ("mask",): {ADJUST},
    ("sample", "filter", "logprobs", "penalties", "bias", "mask"): FEATURES,
}


@pytest.mark.parametrize("parts", list(SCENARIOS), ids=["-".join(p) or "greedy" for p in SCENARIOS])
def test_a_variant_that_covers_the_step_gives_the_cond_programs_outputs(parts):
    rng = np.random.default_rng(len(parts))
    logits = (rng.standard_normal((S, V)) * 2).astype(np.float32)
    b, adjusted = _scenario(parts, logits)
    step_needs = needs(b.temperature, b.top_k, b.top_p, b.min_p, b.num_logprobs, adjusted)
    assert step_needs == SCENARIOS[parts]
    ref = _run(logits, b, None)
    covering = 0
    for variant in (*tuning.SAMPLER_VARIANTS, FEATURES):
        got = _run(logits, b, variant)
        same = (np.array_equal(got.sampled, ref.sampled) and np.array_equal(got.rank, ref.rank)
                and np.array_equal(got.top_ids, ref.top_ids)
                and np.allclose(got.logprob, ref.logprob, atol=1e-6) and np.allclose(got.top_logprobs, ref.top_logprobs,
                                                                                       atol=1e-6))
        if step_needs <= variant:
            covering += 1
            assert same, (parts, sorted(variant))
        else:  # each part of the scenario shows in the outputs: leaving it out must be seen
            assert not same, (parts, sorted(variant))
    assert covering >= 1
    if "mask" in parts:
        assert ref.sampled[12] == 5
    if "penalties" in parts:
        assert ref.sampled[13] != logits[13].argmax() and ref.sampled[14] != logits[14].argmax()


def test_the_variants_are_ordered_and_the_last_covers_every_step():
    variants = tuning.SAMPLER_VARIANTS
    assert all(set(v) <= FEATURES for v in variants)
    assert variants[-1] == FEATURES
    # none is wholly inside one before it (it would never be picked)
    assert all(not variants[j] <= variants[i] for j in range(len(variants)) for i in range(j))
    assert variants[0] == frozenset()  # an all-greedy step without logprobs runs the argmax alone


def test_no_variant_holds_a_cond():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((S, V)).astype(np.float32)
    b, _ = _scenario(("sample",), logits)

    def conds(features):
        text = _sample.lower(*_args(logits, b), features=features).as_text()
        return text.count("stablehlo.case") + text.count("stablehlo.if") + text.count("stablehlo.while")

    assert conds(None) >= 3, "the cond program must hold conds, or this proves nothing"
    for variant in (*tuning.SAMPLER_VARIANTS, FEATURES):
        assert conds(variant) == 0, sorted(variant)


def test_unknown_features_are_refused():
    b = _batch()
    with pytest.raises(ValueError, match="unknown sampler features"):
        _run(np.zeros((S, V), np.float32), b, frozenset({"sample", "beam"}))
