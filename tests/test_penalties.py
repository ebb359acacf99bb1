"""Penalties and min_tokens: the device stage against a numpy copy of vLLM's formulas, the host-side
token tables, admission limits, and end to end against transformers with the penalties in numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiles import no_compilation
from test_parity import SENTENCES, hf_model
from tiny import needs_torch

from jaxsched import LLM, SamplingParams
from jaxsched.core.request import Request
from jaxsched.runner.batch import BatchDescriptor, flat_sizes
from jaxsched.runner.penalties import MASKED, PenaltyTables, check_penalty_capacity, table_capacity
from jaxsched.runner.sampler import SamplerOutput, apply_penalties, sample

ENGINE = {"max_model_len": 96, "max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 8}


def vllm_penalties(logits, prompt, output, presence, frequency, repetition, masked=()):
    """vLLM's apply_penalties (+ min_tokens) for one row, in numpy."""
    V = logits.shape[-1]
    counts = np.bincount(np.asarray(output, np.int64), minlength=V)[:V].astype(np.float64)
    seen = (np.bincount(np.asarray(prompt, np.int64), minlength=V)[:V] > 0) | (counts > 0)
    rep = np.where(seen, repetition, 1.0)
    x = np.where(logits > 0, logits / rep, logits * rep)
    x = x - frequency * counts - presence * (counts > 0)
    x[list(masked)] = -np.inf
    return x


def make_request(rid, prompt, output, eos=(2,), **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=eos)
    r.output_token_ids = list(output)
    return r


def batch_for(reqs: list[Request], tables: PenaltyTables, S: int) -> BatchDescriptor:
    ni, nf = flat_sizes(16, S)
    b = BatchDescriptor.from_flat(np.zeros(ni, np.int32), np.zeros(nf, np.float32), 16, S)
    b.top_p[:] = 1.0
    b.num_logprobs[:] = -1
    for i, r in enumerate(reqs):
        sp = r.sampling_params
        b.temperature[i] = sp.temperature
        b.sample_index[i] = r.num_output_tokens
        if sp.uses_penalties:
            b.presence_penalty[i] = sp.presence_penalty
            b.frequency_penalty[i] = sp.frequency_penalty
            b.repetition_penalty[i] = sp.repetition_penalty
            b.penalty_num[i] = tables.fill_row(r, b.penalty_ids[i], b.penalty_counts[i])
    return b


@jax.jit
def _penalise(logits, fi, ff, pi, pc):
    S = logits.shape[0]
    return apply_penalties(logits, BatchDescriptor.from_flat(fi, ff, 16, S, pi, pc))


@jax.jit
def _sample(logits, fi, ff, pi, pc):
    return sample(logits, BatchDescriptor.from_flat(fi, ff, 16, logits.shape[0], pi, pc), 2)


def test_device_penalties_match_vllm_formulas():
    rng = np.random.default_rng(0)
    S, V = 8, 97
    logits = rng.standard_normal((S, V)).astype(np.float32) * 3
    cases = [  # (prompt, output, params)
        (rng.integers(0, V, 30), rng.integers(0, 20, 40), {"repetition_penalty": 1.3}),
        (rng.integers(0, V, 5), rng.integers(0, V, 60), {"frequency_penalty": 0.7}),
        (rng.integers(0, V, 5), rng.integers(0, 10, 25), {"presence_penalty": -1.5}),
        (rng.integers(0, V, 50), rng.integers(0, V, 50),
         {"repetition_penalty": 0.8, "presence_penalty": 2.0, "frequency_penalty": -2.0}),
        (rng.integers(0, V, 9), [], {"repetition_penalty": 2.0}),  # prompt only: before the first token
        (rng.integers(0, V, 9), rng.integers(0, V, 9), {}),  # no penalties: untouched
        (rng.integers(0, V, 9), [3, 3, 4], {"min_tokens": 5, "stop_token_ids": [7, 3], "frequency_penalty": 1.0}),
        (rng.integers(0, V, 9), [3] * 5, {"min_tokens": 5, "stop_token_ids": [7], "presence_penalty": 1.0}),
    ]
    reqs = [make_request(f"r{i}", p, o, **kw) for i, (p, o, kw) in enumerate(cases)]
    b = batch_for(reqs, PenaltyTables(), S)
    got = np.asarray(_penalise(jnp.asarray(logits), b.flat_i32, b.flat_f32, b.penalty_ids, b.penalty_counts))
    for i, (p, o, kw) in enumerate(cases):
        sp = reqs[i].sampling_params
        masked = {7, 3, 2} if len(o) < sp.min_tokens else set()
        want = vllm_penalties(logits[i].astype(np.float64), p, o, sp.presence_penalty, sp.frequency_penalty,
                              sp.repetition_penalty, masked)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5, err_msg=f"case {i}: {kw}")
    # greedy rows pick the argmax of the penalised logits; logprobs stay those of the raw logits
    b.num_logprobs[:] = 1
    b.temperature[:] = 0.0
    ints, floats = _sample(jnp.asarray(logits), b.flat_i32, b.flat_f32, b.penalty_ids, b.penalty_counts)
    out = SamplerOutput.unpack(np.asarray(ints), np.asarray(floats), S, 2)
    np.testing.assert_array_equal(out.sampled, got.argmax(-1))
    raw_lp = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprob, raw_lp[np.arange(S), out.sampled], rtol=1e-4, atol=1e-4)


@jax.jit
def _penalise_pending(logits, fi, ff, pi, pc, pending):
    b = BatchDescriptor.from_flat(fi, ff, 16, logits.shape[0], pi, pc)
    b.pending_token = pending
    return apply_penalties(logits, b)


def test_a_pending_token_folded_in_on_the_device_equals_the_host_having_read_it():
    """Overlapped scheduling: the host's table holds the outputs read, the sampler folds in the one
    still in flight (sampler.with_pending); the penalties are those of the whole output, and
    min_tokens counts the pending token (fill_row's num_outputs)."""
    rng = np.random.default_rng(1)
    S, V = 8, 97
    logits = rng.standard_normal((S, V)).astype(np.float32) * 3
    cases = [  # (prompt, whole output, params): the output's last token is the pending one
        ([5, 6, 7], [10, 11, 12], {"frequency_penalty": 1.0, "presence_penalty": 0.5}),  # new token
        ([5, 6, 7], [10, 11, 10], {"frequency_penalty": 1.0}),  # seen before: its count rises
        ([5, 6, 7], [10, 6], {"repetition_penalty": 2.0}),  # a prompt token, count 0 before
        ([5, 6, 7], [40], {"frequency_penalty": 2.0}),  # the first output: an empty table before
        ([5, 6, 7], [10, 11], {"min_tokens": 3, "stop_token_ids": [9], "frequency_penalty": 1.0}),  # 2 < 3
        ([5, 6, 7], [10, 11, 12], {"min_tokens": 3, "stop_token_ids": [9], "presence_penalty": 1.0}),  # 3: unmasked
        ([5, 6, 7], [9, 12], {"min_tokens": 5, "stop_token_ids": [11], "ignore_eos": True}),  # min_tokens only
        ([5, 6, 7], [10, 11], {}),  # no penalties: no table, nothing pending
    ]
    reqs = [make_request(f"r{i}", p, o[:-1], **kw) for i, (p, o, kw) in enumerate(cases)]
    tables = PenaltyTables()
    b = batch_for([], tables, S)
    pending = np.full(S, -1, np.int32)
    for i, (r, (_, o, _)) in enumerate(zip(reqs, cases)):
        sp = r.sampling_params
        if sp.uses_penalties:
            b.presence_penalty[i] = sp.presence_penalty
            b.frequency_penalty[i] = sp.frequency_penalty
            b.repetition_penalty[i] = sp.repetition_penalty
            b.penalty_num[i] = tables.fill_row(r, b.penalty_ids[i], b.penalty_counts[i], len(o))
            pending[i] = o[-1]
    assert b.penalty_num[3] == 0, "the first output's row must start from an empty table"
    got = np.asarray(_penalise_pending(jnp.asarray(logits), b.flat_i32, b.flat_f32, b.penalty_ids,
                                       b.penalty_counts, jnp.asarray(pending)))
    for i, (p, o, kw) in enumerate(cases):
        sp = reqs[i].sampling_params
        masked = set(sp.stop_token_ids) | ({2} if not sp.ignore_eos else set()) if len(o) < sp.min_tokens else set()
        want = vllm_penalties(logits[i].astype(np.float64), p, o if sp.uses_penalties else [], sp.presence_penalty,
                              sp.frequency_penalty, sp.repetition_penalty, masked)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5, err_msg=f"case {i}: {kw}")


def test_min_tokens_masks_sampled_rows_too():
    logits = np.full((8, 16), -5.0, np.float32)
    logits[:, 2] = 10.0  # EOS would win every draw
    reqs = [make_request(f"r{i}", [1], [], temperature=1.0, min_tokens=1) for i in range(8)]
    b = batch_for(reqs, PenaltyTables(), 8)
    b.seeds[:] = np.arange(8)
    ints, _floats = _sample(jnp.asarray(logits), b.flat_i32, b.flat_f32, b.penalty_ids, b.penalty_counts)
    assert 2 not in np.asarray(ints)[:8].tolist()
    ignore = [make_request(f"x{i}", [1], [], temperature=1.0, min_tokens=1, ignore_eos=True) for i in range(8)]
    b = batch_for(ignore, PenaltyTables(), 8)  # ignore_eos: EOS is not a stop token, so not masked
    ints, _ = _sample(jnp.asarray(logits), b.flat_i32, b.flat_f32, b.penalty_ids, b.penalty_counts)
    assert set(np.asarray(ints)[:8].tolist()) == {2}


def test_tables_fold_in_new_outputs_and_forget_finished_requests():
    tables = PenaltyTables(capacity=8)
    r = make_request("a", [5, 5, 6], [], repetition_penalty=1.1)
    ids, counts = np.zeros(8, np.int32), np.zeros(8, np.float32)
    assert tables.fill_row(r, ids, counts) == 2 and sorted(ids[:2]) == [5, 6] and not counts.any()
    r.output_token_ids += [6, 9, 9]
    ids[:], counts[:] = 0, 0
    n = tables.fill_row(r, ids, counts)
    assert dict(zip(ids[:n].tolist(), counts[:n].tolist())) == {5: 0.0, 6: 1.0, 9: 2.0}
    # the same id for a new request starts a new table
    r2 = make_request("a", [1], [4], frequency_penalty=0.5)
    ids[:], counts[:] = 0, 0
    n = tables.fill_row(r2, ids, counts)
    assert dict(zip(ids[:n].tolist(), counts[:n].tolist())) == {4: 1.0}
    tables.forget(["a"])
    assert len(tables) == 0
    # min_tokens alone tracks nothing: only the masked stop tokens, EOS included
    r3 = make_request("m", [1, 2, 3], [7], min_tokens=2, stop_token_ids=[11])
    ids[:], counts[:] = 0, 0
    n = tables.fill_row(r3, ids, counts)
    assert sorted(ids[:n].tolist()) == [2, 11] and (counts[:n] == MASKED).all() and len(tables) == 0
    r3.output_token_ids.append(8)
    assert tables.fill_row(r3, ids, counts) == 0


def test_capacity_is_checked_when_a_request_is_made():
    sp = SamplingParams(repetition_penalty=1.2, max_tokens=10)
    check_penalty_capacity(sp, list(range(6)), (2,), max_model_len=96, vocab_size=300, capacity=16)
    with pytest.raises(ValueError, match=r"at most 16 distinct tokens.*could need 17.*set max_tokens <= 9"):
        check_penalty_capacity(sp, list(range(7)), (2,), max_model_len=96, vocab_size=300, capacity=16)
    with pytest.raises(ValueError, match="shorten the prompt or drop repetition_penalty"):
        check_penalty_capacity(sp, list(range(40)), (2,), max_model_len=96, vocab_size=300, capacity=16)
    # without penalties nothing is tracked, whatever the lengths
    check_penalty_capacity(SamplingParams(max_tokens=None), list(range(90)), (2,), 96, 300, capacity=0)
    # an engine's tables hold a whole max_model_len of history (plus room for min_tokens' masks)
    assert table_capacity(96, 300) >= 96 + 2 and table_capacity(4096, 300) == 300
    check_penalty_capacity(SamplingParams(repetition_penalty=1.2, presence_penalty=1.0, max_tokens=None),
                           list(range(90)), (2,), 96, 300, capacity=table_capacity(96, 300))
    with pytest.raises(ValueError, match=r"presence_penalty must be a finite number in \[-2, 2\]"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match=r"frequency_penalty must be a finite number in \[-2, 2\]"):
        SamplingParams(frequency_penalty=float("nan"))
    with pytest.raises(ValueError, match=r"repetition_penalty must be a finite number in \(0, inf\)"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, "):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match=r"min_tokens \(5\) must be <= max_tokens \(4\)"):
        SamplingParams(min_tokens=5, max_tokens=4)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, **ENGINE)


@needs_torch
def test_greedy_with_penalties_matches_transformers_plus_numpy(llm, llama_dir):
    """Teacher-forced on the engine's tokens: at every step the engine's token must be the argmax of
    transformers' logits with vLLM's penalties applied in numpy (up to float noise)."""
    import torch

    tok = llm.get_tokenizer()
    model = hf_model(llama_dir)
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, **kw) for kw in (
        {"repetition_penalty": 1.5}, {"frequency_penalty": 1.2}, {"presence_penalty": 1.5},
        {"repetition_penalty": 0.7, "frequency_penalty": -0.5, "presence_penalty": 0.5}, {})]
    prompts = [tok.encode(SENTENCES[i]) for i in (0, 2, 3, 4, 7)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), use_tqdm=False)
    changed = 0
    for p, sp, o, base in zip(prompts, params, outs, plain):
        got = o.outputs[0].token_ids
        changed += got != base.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([p + got])).logits[0].double().numpy()
        for j, t in enumerate(got):
            row = vllm_penalties(logits[len(p) - 1 + j], p, got[:j], sp.presence_penalty, sp.frequency_penalty,
                                 sp.repetition_penalty)
            assert row[t] >= row.max() - 1e-3, f"{sp}: step {j} took {t}, reference prefers {row.argmax()}"
    assert changed >= 3  # the penalties did change the greedy text


def test_min_tokens_end_to_end(llm):
    tok = llm.get_tokenizer()
    p = {"prompt_token_ids": tok.encode(SENTENCES[3])}
    free = llm.generate([p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    first = free[0].outputs[0].token_ids[0]
    stopped = llm.generate([p], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate([p], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=4),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]
    assert not set(held.token_ids[:4]) & set(llm.llm_engine.eos_token_ids)


def test_penalties_add_no_compilation_after_warm_up(llm):
    tok = llm.get_tokenizer()
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": tok.encode(SENTENCES[i % len(SENTENCES)])[: 2 + i % 30]} for i in range(24)]
    params = [SamplingParams(temperature=float(rng.choice([0.0, 0.9])), seed=i, max_tokens=int(rng.integers(2, 20)),
                             repetition_penalty=float(rng.choice([1.0, 1.3])),
                             presence_penalty=float(rng.choice([0.0, 0.5])),
                             frequency_penalty=float(rng.choice([0.0, -0.4])), min_tokens=int(rng.integers(0, 2)))
              for i in range(24)]
    with no_compilation():
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 24 and all(o.finished for o in outs)


def test_penalties_over_a_whole_context(llm):
    """With tables sized for max_model_len, a penalised request may run to the end of the context
    (this used to be refused once max_tokens passed a fixed 256-entry table)."""
    tok = llm.get_tokenizer()
    p = tok.encode(SENTENCES[1])
    room = llm.llm_engine.scheduler_config.max_model_len - len(p)
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True,
                                                                 repetition_penalty=1.3, presence_penalty=0.8),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == room and out.finish_reason == "length"
    assert llm.llm_engine.config.penalty_capacity >= llm.llm_engine.scheduler_config.max_model_len
