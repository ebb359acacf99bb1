"""prompt_logprobs (vLLM's SamplingParams field): each prompt token's logprob under the model given
the tokens before it, its rank and the k most likely tokens there; the first token's entry is None.
Checked against transformers' float32 log-softmax (1e-4) on the tiny models, over prompts longer
than a step (chunked prefill), beside other requests, with n > 1, after preemption by recompute
(nothing sent twice), and with a prefix the cache holds (not taken: the whole prompt is scored)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from compiles import no_compilation
from test_parity import SENTENCES, hf_model

from jaxsched import LLM, SamplingParams
from jaxsched.errors import InvalidRequestError

torch = pytest.importorskip("torch")  # transformers' models are the ground truth (the parity extra)

BASE = {"max_model_len": 160, "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 8,
        "step_cost_model": False}


def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    """f32[len(ids) - 1, V]: log-softmax of transformers' logits at each position but the last."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def check(out, ref: np.ndarray, k: int) -> None:
    pl = out.prompt_logprobs
    ids = out.prompt_token_ids
    assert pl is not None and len(pl) == len(ids) and pl[0] is None
    for t in range(1, len(ids)):
        entry, want = pl[t], ref[t - 1]
        assert ids[t] in entry
        got = entry[ids[t]]
        assert abs(got.logprob - want[ids[t]]) < 1e-4, (t, got.logprob, want[ids[t]])
        assert got.rank == int((want > want[ids[t]]).sum()) + 1
        top = sorted(((e.rank, tok, e.logprob) for tok, e in entry.items() if tok != ids[t] or e.rank <= k))[:k]
        best = np.argsort(-want, kind="stable")[:k]
        assert [tok for _, tok, _ in top] == best.tolist() or np.allclose(
            sorted(want[best]), sorted(lp for *_, lp in top), atol=1e-4)  # ties may order either way
        for _, tok, lp in top:
            assert abs(lp - want[tok]) < 1e-4


@pytest.mark.parametrize("kind", ["llama", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_prompt_logprobs_equal_transformers(kind, model_dirs):
    folder = model_dirs[kind]
    ref_model = hf_model(folder)
    llm = LLM(folder, **BASE)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(" ".join(SENTENCES[i:] + SENTENCES[:i]))[: 20 + 25 * i] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3 if i % 2 == 0 else 0)
              for i in range(3)] + [SamplingParams(temperature=0, max_tokens=6)]  # one without, beside them
    # the first request asking for them compiles their program, before it is scheduled; then no more
    assert not llm.llm_engine.core.runner._prompt
    llm.generate([{"prompt_token_ids": prompts[0][:3]}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                 use_tqdm=False)
    with no_compilation():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert max(len(p) for p in prompts) > BASE["max_num_batched_tokens"], "a prompt longer than a step"
    for i, o in enumerate(outs[:3]):
        check(o, hf_logprobs(ref_model, prompts[i]), params[i].prompt_logprobs)
    assert outs[3].prompt_logprobs is None
    # the prompt is now in the prefix cache; a request owing prompt logprobs scores it whole anyway
    again = llm.generate([{"prompt_token_ids": prompts[2]}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                         use_tqdm=False)[0]
    check(again, hf_logprobs(ref_model, prompts[2]), 2)
    assert outs[2].outputs[0].token_ids[:1] == again.outputs[0].token_ids


def test_n_samples_and_recompute_send_each_entry_once(llama_dir):
    ref_model = hf_model(llama_dir)
    llm = LLM(llama_dir, **BASE, num_gpu_blocks_override=9, preemption_mode="recompute")
    tok = llm.get_tokenizer()
    prompts = [tok.encode(SENTENCES[i] + " " + SENTENCES[(i + 3) % len(SENTENCES)])[:30] for i in range(4)]
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.stats().num_preemptions > 0, "the small pool must force recomputes"
    for p, o in zip(prompts, outs):
        check(o, hf_logprobs(ref_model, p), 1)


def test_prompt_logprobs_over_the_servers_maximum_is_refused(llama_dir):
    llm = LLM(llama_dir, **BASE, max_logprobs=5)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be <= max_logprobs") as e:
        llm.generate(["hello"], SamplingParams(prompt_logprobs=6), use_tqdm=False)
    assert e.value.param == "prompt_logprobs"
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be an integer"):
        SamplingParams(prompt_logprobs=-1)


def test_both_openai_routes_return_them(llama_dir):
    """/v1/completions: per choice; /v1/chat/completions: at the top, for the rendered chat's tokens
    (vLLM's shapes: {token id: {logprob, rank, decoded_token}}, null first). More than
    max_logprobs, is a 400 naming the field; a stream has them in its first chunk."""
    import httpx
    from servers import uvicorn_thread

    from serving.app import build_app
    from serving.async_engine import AsyncEngine

    llm = LLM(llama_dir, **BASE, max_logprobs=4)
    tok = llm.get_tokenizer()
    prompt = "the capital of france is paris . the capital of"
    ids = tok.encode(prompt)
    offline = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),
                           use_tqdm=False)[0].prompt_logprobs
    engine = AsyncEngine(llm.llm_engine)
    with uvicorn_thread(build_app(engine, served_model_name="tiny")) as url:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2, "n": 2}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        r_first = r.json()
        for choice in r.json()["choices"]:
            pl = choice["prompt_logprobs"]
            assert len(pl) == len(ids) and pl[0] is None
            for t in range(1, len(ids)):
                assert set(pl[t]) == {str(k) for k in offline[t]}
                e = pl[t][str(ids[t])]
                assert abs(e["logprob"] - offline[t][ids[t]].logprob) < 1e-5 and e["rank"] == offline[t][ids[t]].rank
                assert e["decoded_token"] == offline[t][ids[t]].decoded_token
        r = httpx.post(f"{url}/v1/completions", json={**body, "prompt_logprobs": None}, timeout=60)
        assert r.json()["choices"][0]["prompt_logprobs"] is None
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2,
                "prompt_logprobs": 1}
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        pl = r.json()["prompt_logprobs"]
        assert pl[0] is None and len(pl) == r.json()["usage"]["prompt_tokens"] and all(1 <= len(e) <= 2 for e in pl[1:])
        # a stream: in the first chunk of the choices, once
        for route, req in (("completions", {**body, "n": 1}), ("chat/completions", chat)):
            with httpx.stream("POST", f"{url}/v1/{route}", json={**req, "stream": True}, timeout=60) as resp:
                chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                          if line.startswith("data: {")]
            carried = [c for c in chunks if c.get("prompt_logprobs") is not None
                       or any(ch.get("prompt_logprobs") is not None for ch in c["choices"])]
            assert len(carried) == 1, route
            got = carried[0].get("prompt_logprobs") or carried[0]["choices"][0]["prompt_logprobs"]
            assert got[0] is None and len(got) > 1
            if route == "completions":
                assert got == r_first["choices"][0]["prompt_logprobs"]
        r = httpx.post(f"{url}/v1/completions", json={**body, "prompt_logprobs": 5}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        assert "max_logprobs" in r.json()["error"]["message"]
    engine.shutdown()
