"""The requests a benchmark sends: synthetic (uniform lengths, or a long tail of outputs) or read
from a file (JSONL of prompts, or a ShareGPT-style JSON conversation dump).

Synthetic prompts are random token ids where the vocabulary is known (offline, in the engine), and
random common words where it is not (a client of some server), one word per wanted token: the
server's own count (usage.prompt_tokens) is what the serve benchmark reports.

The uniform workload draws exactly what scripts/bench_offline.py always drew (same generator, same
order), so its figures stay comparable with the ones in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

WORKLOADS = ("uniform", "long-tail", "copy")
# Sizes per synthetic workload when the flags are not given. The long tail's outputs are short (16
# to 64 tokens) but a tenth of them 10x longer (160 to 640): with prompts of 16 to 128 tokens every
# request fits max_model_len 1024.
SIZE_DEFAULTS: dict[str, dict[str, int]] = {
    "uniform": {"min_prompt": 16, "max_prompt": 512, "min_output": 16, "max_output": 256},
    "long-tail": {"min_prompt": 16, "max_prompt": 128, "min_output": 16, "max_output": 64},
    # copy: the passage's tokens (prompt) and the tokens asked for beyond it (output), passages.py
    "copy": {"min_prompt": 100, "max_prompt": 400, "min_output": 48, "max_output": 48},
}
DEFAULT_NUM_REQUESTS = 128
# common English words: each is one token (with its leading space) in most BPE vocabularies
_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part")
_WORDS = np.array(_WORD_TEXT.split())


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its prompt (token ids or text), how many tokens it asks for, and
    the prompt's length in tokens where it is known here."""

    prompt: str | list[int]
    output_len: int
    prompt_len: int | None = None
    # False: the request ends at EOS (the copy workload: its answer ends where the passage does);
    # the synthetic and file workloads produce exactly output_len tokens
    ignore_eos: bool = True


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="uniform",
                   help="synthetic lengths: 'uniform' (prompt and output lengths uniform in their ranges), "
                        "'long-tail' (outputs uniform in their range, but --long-share of them --long-factor "
                        "times longer), 'copy' (chat prompts asking to repeat or lightly edit a passage of "
                        "--min-prompt..--max-prompt tokens, answered up to EOS or the passage's length plus "
                        "--max-output; speculative decoding's best case); ignored with --dataset")
    g.add_argument("--num-requests", "--num-prompts", "-n", dest="num_requests", type=int, default=None,
                   help=f"requests (default: {DEFAULT_NUM_REQUESTS}, or every request of --dataset)")
    for name in ("min-prompt", "max-prompt", "min-output", "max-output"):
        defaults = ", ".join(f"{w} {d[name.replace('-', '_')]}" for w, d in SIZE_DEFAULTS.items())
        g.add_argument(f"--{name}", type=int, default=None, help=f"tokens, inclusive (default: {defaults})")
    g.add_argument("--long-share", type=float, default=0.1, help="long-tail: share of long requests (default 0.1)")
    g.add_argument("--long-factor", type=int, default=10,
                   help="long-tail: a long request's output is this many times a short one's (default 10)")
    g.add_argument("--dataset", metavar="FILE", default=None,
                   help="requests from FILE instead: JSONL lines {\"prompt\": text or token ids, "
                        "\"max_tokens\": N}, or a ShareGPT-style JSON list of {\"conversations\": "
                        "[{\"from\": \"human\", \"value\": ...}, {\"from\": \"gpt\", \"value\": ...}]} "
                        "(prompt: the first turn; output length: the reply's tokens)")
    g.add_argument("--output-len", type=int, default=None,
                   help="--dataset: every request asks for this many tokens (overrides the file's)")


def resolve_sizes(ns: argparse.Namespace) -> None:
    """Fill the size flags left unset with the chosen workload's defaults (in place)."""
    for k, v in SIZE_DEFAULTS[ns.workload].items():
        if getattr(ns, k) is None:
            setattr(ns, k, v)
    if not 1 <= ns.min_prompt <= ns.max_prompt or not 1 <= ns.min_output <= ns.max_output:
        raise ValueError(f"need 1 <= --min-prompt <= --max-prompt and 1 <= --min-output <= --max-output, got "
                         f"prompts {ns.min_prompt}..{ns.max_prompt}, outputs {ns.min_output}..{ns.max_output}")
    if not 0.0 <= ns.long_share <= 1.0 or ns.long_factor < 1:
        raise ValueError(f"--long-share must be in [0, 1] and --long-factor >= 1, got {ns.long_share}, "
                         f"{ns.long_factor}")


def synthetic(ns: argparse.Namespace, vocab_size: int | None) -> list[BenchRequest]:
    """The synthetic workload of `ns`: prompts of random token ids in [0, vocab_size), or of random
    words without a vocab size."""
    resolve_sizes(ns)
    n = ns.num_requests or DEFAULT_NUM_REQUESTS
    rng = np.random.default_rng(ns.seed)
    prompt_lens = rng.integers(ns.min_prompt, ns.max_prompt + 1, n)
    output_lens = rng.integers(ns.min_output, ns.max_output + 1, n)
    if ns.workload == "long-tail":
        long = rng.choice(n, size=round(ns.long_share * n), replace=False)
        output_lens[long] *= ns.long_factor
    if vocab_size is not None:
        prompts: list[Any] = [rng.integers(0, vocab_size, p).tolist() for p in prompt_lens]
    else:
        prompts = [" ".join(_WORDS[rng.integers(0, len(_WORDS), p)]) for p in prompt_lens]
    return [BenchRequest(pr, int(o), int(p)) for pr, o, p in zip(prompts, output_lens, prompt_lens)]


def load_dataset(path: str, n: int | None, seed: int, tokenizer: Any | None, output_len: int | None,
                 max_model_len: int | None) -> list[BenchRequest]:
    """Requests from a JSONL file (in file order) or a ShareGPT-style JSON file (shuffled with
    `seed`, as vLLM samples it). Requests longer than max_model_len (where lengths are known) and
    ShareGPT pairs under 4 tokens either side are skipped, with a log line."""
    text = Path(path).read_text()
    sharegpt = text.lstrip().startswith("[")
    rows = _sharegpt_rows(text, seed) if sharegpt else _jsonl_rows(text, path)
    out: list[BenchRequest] = []
    skipped = 0
    for prompt, max_tokens, reply in rows:
        if n is not None and len(out) >= n:
            break
        plen = len(prompt) if isinstance(prompt, list) else (len(tokenizer.encode(prompt)) if tokenizer else None)
        olen = output_len or max_tokens
        if olen is None and reply is not None:
            if tokenizer is None:
                raise ValueError(f"{path}: ShareGPT output lengths are the replies' token counts, which need a "
                                 "tokenizer: pass --tokenizer, or --output-len N")
            olen = len(tokenizer.encode(reply))
        if olen is None:
            raise ValueError(f"{path}: a line has no max_tokens; add it, or pass --output-len N")
        too_long = max_model_len is not None and plen is not None and plen + olen > max_model_len
        if too_long or (sharegpt and ((plen is not None and plen < 4) or olen < 4)):
            skipped += 1
            continue
        out.append(BenchRequest(prompt, int(olen), plen))
    if skipped:
        logger.info("%s: skipped %d requests (longer than max_model_len %s, or a ShareGPT side under 4 tokens)",
                    path, skipped, max_model_len)
    if not out:
        raise ValueError(f"{path}: no usable requests")
    return out


def _jsonl_rows(text: str, path: str) -> list[tuple[Any, int | None, None]]:
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON: {e}") from None
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
            raise ValueError(f"{path}:{i}: needs \"prompt\": a string or a list of token ids")
        rows.append((prompt, obj.get("max_tokens"), None))
    return rows


def _sharegpt_rows(text: str, seed: int) -> list[tuple[str, None, str]]:
    data = json.loads(text)
    pairs = []
    for entry in data:
        if not isinstance(entry, dict):
            continue
        conv = entry.get("conversations") or entry.get("conversation") or []
        if len(conv) >= 2 and isinstance(conv[0].get("value"), str) and isinstance(conv[1].get("value"), str):
            pairs.append((conv[0]["value"], None, conv[1]["value"]))
    order = np.random.default_rng(seed).permutation(len(pairs))
    return [pairs[i] for i in order]


def build(ns: argparse.Namespace, vocab_size: int | None = None, tokenizer: Any | None = None,
          max_model_len: int | None = None) -> list[BenchRequest]:
    """The workload `ns` asks for: --dataset, else the synthetic one."""
    if ns.dataset:
        return load_dataset(ns.dataset, ns.num_requests, ns.seed, tokenizer, ns.output_len, max_model_len)
    if ns.workload == "copy":
        return copy(ns, tokenizer)
    return synthetic(ns, vocab_size)


def copy(ns: argparse.Namespace, tokenizer: Any | None) -> list[BenchRequest]:
    """The copy workload (passages.py): each request ends at EOS, or at its passage's length plus
    --max-output tokens."""
    from jaxsched.bench.passages import copy_prompts

    if tokenizer is None:
        raise ValueError("--workload copy renders chat prompts, which needs the model's tokenizer (the offline "
                         "benchmark has it; for `bench serve` pass --tokenizer)")
    if ns.min_output is None and ns.max_output is not None:  # one figure: --max-output
        ns.min_output = ns.max_output
    resolve_sizes(ns)
    n = ns.num_requests or DEFAULT_NUM_REQUESTS
    return [BenchRequest(ids, size + ns.max_output, len(ids), ignore_eos=False)
            for ids, size in copy_prompts(tokenizer, n, ns.min_prompt, ns.max_prompt, ns.seed)]


def describe(ns: argparse.Namespace, reqs: list[BenchRequest]) -> dict[str, Any]:
    """The workload's part of a JSON result."""
    d: dict[str, Any] = {"num_requests": len(reqs), "seed": ns.seed,
                         "requested_output_tokens": sum(r.output_len for r in reqs)}
    if ns.dataset:
        d.update(name="dataset", dataset=ns.dataset, output_len=ns.output_len)
    else:
        d.update(name=ns.workload, min_prompt=ns.min_prompt, max_prompt=ns.max_prompt, min_output=ns.min_output,
                 max_output=ns.max_output)
        if ns.workload == "long-tail":
            d.update(long_share=ns.long_share, long_factor=ns.long_factor)
    if all(r.prompt_len is not None for r in reqs):
        d["prompt_tokens"] = sum(r.prompt_len for r in reqs)
    return d
