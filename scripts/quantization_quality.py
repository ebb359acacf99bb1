"""What each weight quantization and KV cache dtype costs on the demo model (or --model): the
weights' bytes on the device against float32's, the KV pool's bytes per token, how many of 16 chat prompts keep float32's first 32 greedy tokens, the
Paris answer, and the mean log-likelihood per token of each mode's greedy answers scored by the
float32 model (transformers, so the scorer is not the engine under test; torch must be installed:
`make test` installs it). Prints a Markdown table (docs/PERFORMANCE.md has the current one).

  python scripts/quantization_quality.py
  python scripts/quantization_quality.py --modes float32 int8 int8+embedding
"""

from __future__ import annotations

import argparse
import gc
import os

PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
    "Write a haiku about the sea.", "What is 12 times 7?", "Explain photosynthesis in one sentence.",
    "Give me a synonym for happy.", "What does a thermometer measure?", "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?", "List the days of the week.", "What is the boiling point of water?",
    "Suggest a name for a pet cat.", "Why is the sky blue?", "What is the largest planet in our solar system?",
    "Describe a rainbow to a child.",
]
# name -> engine arguments
MODES = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int8+embedding": {"quantization": "int8", "quantize_embedding": True},
    "fp8": {"quantization": "fp8"},
    "fp8+embedding": {"quantization": "fp8", "quantize_embedding": True},
    "KV bfloat16": {"kv_cache_dtype": "bfloat16"},
    "KV fp8": {"kv_cache_dtype": "fp8"},
}


def run(model: str | None, args: dict, n: int) -> dict:
    from jaxsched import LLM, SamplingParams

    llm = LLM(model, max_model_len=512, max_num_seqs=16, **args)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    res = {"prompts": [o.prompt_token_ids for o in outs], "tokens": [list(o.outputs[0].token_ids) for o in outs],
           "paris": "Paris" in outs[0].outputs[0].text, "weights": llm.llm_engine.memory_report().weights,
           "kv_token": llm.llm_engine.kv_bytes_per_device() // llm.llm_engine.memory_report().kv_tokens}
    del llm
    gc.collect()
    return res


def scorer(model: str | None):
    """score(prompt ids, answer ids) -> the mean log-probability of the answer's tokens under
    transformers' float32 model of the same checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxsched.models.demo import demo_model_path

    path = model or str(demo_model_path())
    if path.endswith(".gguf"):
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  torch_dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    hf.eval()

    def score(prompt: list[int], answer: list[int]) -> float:
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0, :-1].float(), dim=-1)
        picked = logp[len(prompt) - 1:, :].gather(1, torch.tensor(answer)[:, None])
        return float(picked.mean())

    return score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder or .gguf file (default: the demo model)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    modes = ["float32", *[m for m in a.modes if m != "float32"]]
    results = {m: run(a.model, MODES[m], a.tokens) for m in modes}
    score = scorer(a.model)
    ref = results["float32"]
    print(f"| mode | weight bytes vs float32 | KV bytes / token | prompts with float32's {a.tokens} tokens "
          f"(of {len(PROMPTS)}) | Paris | mean log-likelihood / token (float32 scorer) |")
    print("|---|---|---|---|---|---|")
    for m in modes:
        r = results[m]
        same = sum(t == u for t, u in zip(r["tokens"], ref["tokens"]))
        ll = sum(score(p, t) for p, t in zip(r["prompts"], r["tokens"])) / len(PROMPTS)
        print(f"| {m} | {r['weights'] / ref['weights']:.3f} ({r['weights'] / 2**20:.0f} MiB) | {r['kv_token']} | {same} "
              f"| {'yes' if r['paris'] else 'no'} | {ll:.4f} |", flush=True)


if __name__ == "__main__":
    main()
