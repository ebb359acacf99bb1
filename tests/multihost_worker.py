"""One process of a two-process engine on loopback (or, without a coordinator, the single-process
reference run), for tests/test_multihost.py. The same script runs as every process, SPMD style:
process 0's batches are the ones run, the others follow them (LLM.generate, LLMEngine.follow).

    XLA_FLAGS=--xla_force_host_platform_device_count=1 \
        python tests/multihost_worker.py '{"model": DIR, "coordinator": "127.0.0.1:PORT", "process_id": 0}'
    python tests/multihost_worker.py '{"model": DIR}'          # the reference: one process, one device

Prints one line per phase, "RESULT <phase> {...}", for the test to compare across processes and
with the reference:
  init    the process's place in the cluster and the engine's device count
  batch1  LLM.generate of PROMPTS, greedy: a prefill longer than a step's budget (chunked), a pool
          small enough to preempt
  batch2  a second LLM.generate with another batch (the followers' follow(until="idle") returned
          and picked up the next one), one request sampled with a seed the leader drew
  abort   the engine driven by hand: requests added, a few steps, one aborted, the rest run out
  stop    the leader's shutdown(): the followers' follow() returns
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A prompt of 150 tokens, longer than max_num_batched_tokens (32): chunked prefill. Six prompts over
# 11 usable blocks of 16 tokens (12 with the null page): 5 preemptions, by recompute. Four sequences
# at most per step.
PROMPTS = [
    "the capital of france is",
    "hello world , how are you today ? " * 6,
    "one two three four five six",
    "dogs and cats like to play in the sun .",
    "language models predict the next token",
    "jax runs on gpus and cpus . " * 3,
]
ENGINE = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 16,
          "num_gpu_blocks_override": 12, "enable_prefix_caching": False, "preemption_mode": "recompute",
          "attention_backend": "xla"}
BATCH2 = [
    "what is a cat ? " * 5,
    "numbers 12345 67890",
    "seven eight nine ten . hello",
]
ABORT = ["one two three", "the sun . " * 4, "jax runs on"]
ABORTED, ABORT_AFTER_STEPS = "abort-1", 4


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _print(phase: str, **payload) -> None:
    print(f"RESULT {phase} " + json.dumps(payload), flush=True)


def build(spec: dict):
    """The LLM: tensor_parallel_size=2 over two processes of one device each with a coordinator,
    else one process and one device (the reference)."""
    from jaxsched import LLM

    kwargs = dict(ENGINE)
    if spec.get("coordinator"):
        kwargs.update(tensor_parallel_size=2, distributed_coordinator=spec["coordinator"], num_processes=2,
                      process_id=spec["process_id"])
    return LLM(spec["model"], **kwargs)


def run(llm, emit: Callable[..., None] = _print) -> None:
    """Every phase, on any process (the same calls on each: SPMD)."""
    import jax

    from jaxsched import SamplingParams

    eng = llm.llm_engine
    multi = jax.process_count() > 1
    leads = eng.is_leader
    emit("init", process_index=jax.process_index(), process_count=jax.process_count(),
         device_count=jax.device_count(), local_device_count=jax.local_device_count(),
         engine_devices=eng.info.num_devices)

    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    emit("batch1", tokens=_tokens(outs), ids=[o.request_id for o in outs], finished=[o.finished for o in outs],
         prompt_lens=[len(o.prompt_token_ids) for o in outs], preemptions=eng.stats().num_preemptions,
         unfinished=eng.has_unfinished_requests())

    sampled = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)  # its seed: the leader's draw
    outs = llm.generate(BATCH2 + ["hello world"], [greedy] * len(BATCH2) + [sampled], use_tqdm=False)
    emit("batch2", tokens=_tokens(outs), ids=[o.request_id for o in outs], finished=[o.finished for o in outs],
         unfinished=eng.has_unfinished_requests())

    # An abort between steps, through the engine's own interface (the server's path).
    last: dict[str, list[int]] = {}
    if leads:
        for i, p in enumerate(ABORT):
            eng.add_request(f"abort-{i}", p, greedy)
        steps = 0
        while eng.has_unfinished_requests():
            if steps == ABORT_AFTER_STEPS:
                eng.abort_request(ABORTED)
            for o in eng.step():
                last[o.request_id] = list(o.outputs[0].token_ids)
            steps += 1
        if multi:
            eng.end_batch()
        added = [f"abort-{i}" for i in range(len(ABORT))]
    else:
        added, outs = eng.follow(until="idle")
        for o in outs:
            last[o.request_id] = list(o.outputs[0].token_ids)
    emit("abort", added=added, tokens={k: last[k] for k in sorted(last)}, unfinished=eng.has_unfinished_requests())

    if multi:
        if eng.is_leader:
            eng.shutdown()
            emit("stop", published=True)
        else:
            added, outs = eng.follow()  # returns on the leader's "stop"
            emit("stop", added=added, outputs=len(outs))


if __name__ == "__main__":
    run(build(json.loads(sys.argv[1])))
