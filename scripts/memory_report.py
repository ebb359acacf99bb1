"""The start-up memory report against what the process really took: RSS after an engine started
minus RSS before it loaded anything (its code and libraries imported, the runtime up), and the
report's weights + KV pool + swap + workspace + compiled programs (on a CPU every figure is host
memory). Prints both and their ratio.

  python scripts/memory_report.py                       # the demo model, its defaults
  python scripts/memory_report.py --model path --swap-space 1
"""

from __future__ import annotations

import argparse


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder, .gguf file or Hub id (default: the demo model)")
    p.add_argument("--swap-space", type=float, default=0.5, help="GiB of host swap pool")
    p.add_argument("--max-model-len", type=int, default=2048)
    a = p.parse_args()
    import jax

    import jaxsched.engine.core  # noqa: F401 - the code and its libraries are not the engine's memory
    from jaxsched import LLM

    jax.devices()  # nor is the runtime
    before = rss()

    llm = LLM(a.model, max_model_len=a.max_model_len, swap_space=a.swap_space, preemption_mode="swap")
    after = rss()
    r = llm.llm_engine.memory_report()
    counted = r.weights + r.kv_pool + r.swap + r.workspace + r.programs
    mib = 2**20
    print(r.lines())
    print(f"RSS after start - RSS before loading: {(after - before) / mib:.1f} MiB; weights + KV pool + swap + "
          f"workspace + programs: {counted / mib:.1f} MiB; ratio {(after - before) / counted:.3f}")


if __name__ == "__main__":
    main()
