"""Greedy outputs of the demo model with speculative decoding (ngram, or any speculative_config) on and off, on one engine.

Each prompt's tokens must be the same both ways; where they differ, the first difference is
reported with the gap between the two most likely tokens there (the run without speculation's
top-2 logprobs): a step that verifies proposals computes a row at other batch shapes, so a near
tie (gap below 1e-4) may fall the other way by float rounding. One JSON line.

  python scripts/spec_parity.py [--requests 16] [--max-num-seqs 8] [--max-tokens 256]
      [--speculative-config '{"method": "draft_model", "model": "<folder or .gguf>"}']
"""

from __future__ import annotations

import argparse
import json
import math

from jaxsched import LLM, SamplingParams
from jaxsched.bench.passages import copy_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--speculative-config", default=None,
                   help="JSON; default: ngram with --num-speculative-tokens")
    ns = p.parse_args()
    spec = json.loads(ns.speculative_config) if ns.speculative_config else \
        {"method": "ngram", "num_speculative_tokens": ns.num_speculative_tokens}
    llm = LLM(max_num_seqs=ns.max_num_seqs, max_model_len=1024, speculative_config=spec)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": ids} for ids, _ in copy_prompts(tok, ns.requests, 100, 400, seed=0)]
    params = SamplingParams(temperature=0, max_tokens=ns.max_tokens, logprobs=2)
    runs = {}
    for on in (False, True):
        llm.llm_engine.client.call_utility("set_speculation", on)
        llm.llm_engine.client.call_utility("reset_prefix_cache")
        runs[on] = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.stats()
    same, diffs = 0, []
    for i, (a, b) in enumerate(zip(runs[False], runs[True])):
        x, y = a.outputs[0].token_ids, b.outputs[0].token_ids
        if x == y:
            same += 1
            continue
        j = next((k for k, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        gap = None
        if j < len(x):
            top = sorted((lp.logprob for lp in a.outputs[0].logprobs[j].values()), reverse=True)
            gap = top[0] - top[1] if len(top) > 1 else math.inf
        diffs.append({"prompt": i, "position": j, "top2_logprob_gap": gap})
    print(json.dumps({"prompts": len(prompts), "identical": same, "differences": diffs,
                      "gap_below_1e-4": all(d["top2_logprob_gap"] is not None and d["top2_logprob_gap"] < 1e-4
                                            for d in diffs),
                      "proposals_verified": stats.spec_decode_num_draft_tokens,
                      "proposals_kept": stats.spec_decode_num_accepted_tokens}))


if __name__ == "__main__":
    main()
