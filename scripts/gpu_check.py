"""GPU check of attention backend "pallas": correctness, kernel timings, engine throughput, one JSON.

  scripts/gpu_check.sh [OUT.json]          on the GPU machine (sets up the environment, calls this)
  python scripts/gpu_check.py --dry-run    on a CPU: tiny shapes, interpret mode; proves the script runs

Phases, each in its own subprocess (so each starts with the GPU's memory free) with a time limit
inside a total budget; the JSON is rewritten after every phase, so a phase that fails or runs out
of time still leaves the others' figures. They run most wanted first, each limited to its share of
the budget (SHARES): model, bench (the traced run first, then unrolled layers, the other sampler,
the other backends, tensor parallelism), sampler, and the already measured kernel matrix last:
  kernels  1. "pallas" against reference_attention on the GPU: bf16 and f32, G = 1, 4, 7, 8,
              pages 8 to 128, ragged prefill + decode rows, a split-K decode.
           2. denominators: device-to-device copy bandwidth (y = x + 1 over 1 GiB: bytes read +
              written), read-only bandwidth (a sum over 1 GiB), bf16 matmul TFLOP/s (8192^3 dots
              chained in one jit), and the card's published figures (PUBLISHED) beside them.
           3. timings of backends "pallas" and "xla": decode B = 64, 256 x context 512, 2048, 8192
              (N = 32, K = 8, H = 128, P = 16, bf16), a mixed prefill + decode step (4 chunks of 256
              tokens + 252 decodes at 2048) and a prefill step (4 prompts of 512). GB/s = bytes of KV
              read (every sequence's K and V once) / time, and its share of the copy bandwidth.
  model    a random-weight Llama-3.2-1B-shaped checkpoint (safetensors, float16 storage, run in
           bf16) with a word-level tokenizer covering its whole vocab.
  bench    scripts/bench_offline.py on that model once per attention backend, each at its default
           block size (16 pallas, 128 xla; its JSON records it): output tokens/s (the first backend
           with overlapped scheduling off then on: the device's idle share without it, the host's
           share of a step with it, and the speedup; then one more run under jax.profiler.trace:
           the device's busy time per step as the device saw it); then, where the machine has
           more than one GPU, "pallas" at tensor_parallel_size=2 (else it says it
           skipped it). Between the first backend and the others: "pallas" with overlap on and
           the sampler's other choice (sampler_branches=device: lax.conds, which XLA:GPU turns
           into waits for the device), then with layer_weights=unrolled (the layers without a loop).
  sampler  scripts/bench_sampler.py --variants: each cond-free sampler program alone (greedy rows,
           V of the 1B model, S = 64 and 256), and the cond program.

Timing: a figure is the median over --runs runs of one jitted fori_loop of --iters calls, each
call's queries being the previous call's output (so no call can be hoisted or skipped), divided by
--iters, after a warm-up run; block_until_ready ends each run. The host's dispatch is thus outside
the measured loop: it is device time.

Table to fill in from the JSON (not yet measured on the H200):
  | case                       | pallas ms | pallas GB/s | % of copy | xla ms |
  | decode B=64  ctx=512       |           |             |           |        |
  | decode B=64  ctx=2048      |           |             |           |        |
  | decode B=64  ctx=8192      |           |             |           |        |
  | decode B=256 ctx=512       |           |             |           |        |
  | decode B=256 ctx=2048      |           |             |           |        |
  | decode B=256 ctx=8192      |           |             |           |        |
  | mixed T=2048 S=256         |           |             |           |        |
  | prefill T=2048 (4 x 512)   |           |             |           |        |
  | denominators: copy ____ GB/s, read ____ GB/s, published ____ GB/s (kernels.copy_gb_s, read_gb_s,
  |   published_gb_s); bf16 matmul ____ TFLOP/s of ____ published (matmul_tflop_s, published_tflop_s)
  | pallas decode GB/s as a share of the read-only figure (timings.*.pallas.fraction_of_read) and of the
  |   published one (fraction_of_published)
  | engine output tokens/s, 1B bf16: pallas ____  xla ____  (copy bandwidth ____ GB/s)
  | pallas, overlap off / on: device idle ____ % (device_idle_share), host share of a step with overlap
  |   ____ % (host_share_with_overlap), speedup ____x (overlap_speedup); host ms per step by phase
  |   (host_ms_per_step_by_phase: schedule, pack, launch, update, output)
  | pallas, profiler trace of one more run: device busy ____ ms a step (trace.device_busy_ms_per_step)
  |   = ____ % of the untraced run's wall time per step (device_busy_share); top kernels and host regions
  | engine output tokens/s, 1B bf16, pallas, tensor_parallel_size=2: ____ (or "skipped: 1 device")
  | engine output tokens/s, 1B bf16, pallas, layer_weights=unrolled: ____ against the stacked run's
  |   above; its warm-up ____ s (pallas_unrolled.warmup_s)
  | pallas, overlap on, sampler_branches=device (one sampler program with lax.conds): ____ tokens/s,
  |   launch ____ ms a step (pallas_sampler_device), against the first run's (sampler_branches
  |   "host", the GPU default: its sampler_branches field says which ran)
  | sampler variants alone, V = 128256, S = 64 / 256, ms per call (sampler_variants.ms): argmax ____,
  |   with the filters' sort ____, everything but the filters ____, the cond program ____
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True,
            "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
LLAMA_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000, "tie_word_embeddings": True,
              "rope_theta": 10000.0, "max_position_embeddings": 512}


# ---------------------------------------------------------------------------------------------------
# kernels phase
# ---------------------------------------------------------------------------------------------------
def make_batch(rng, rows, *, T, S, P, M, pages_in_pool):
    """Block tables over a random permutation of the pool, for rows of (q_len, cached context)."""
    bt = np.zeros((S, M), np.int32)
    seq_lens = np.zeros(S, np.int32)
    qsl = np.zeros(S + 1, np.int32)
    perm = rng.permutation(pages_in_pool - 1) + 1  # never the null page 0
    used = 0
    for i, (q, c) in enumerate(rows):
        nb = -(-(q + c) // P)
        bt[i, :nb] = perm[used : used + nb]
        used += nb
        seq_lens[i] = q + c
        qsl[i + 1] = qsl[i] + q
    qsl[len(rows) + 1 :] = qsl[len(rows)]
    assert used < pages_in_pool and qsl[-1] <= T, (used, pages_in_pool, qsl[-1], T)
    return bt, seq_lens, qsl, np.asarray([len(rows)], np.int32)


def check_correctness(dry: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import paged_attention, reference_attention

    rng = np.random.default_rng(0)
    mixed = [(1, 1000), (200, 100), (1, 0), (64, 0), (17, 511), (1, 2047), (33, 31)]
    cases = [  # name, N, K, H, P, dtype, rows, S, T
        ("G4 P16 bf16 mixed", 32, 8, 128, 16, "bfloat16", mixed, 16, 512),
        ("G1 P8 f32 mixed", 8, 8, 64, 8, "float32", mixed, 16, 512),
        ("G7 P128 bf16 mixed", 28, 4, 128, 128, "bfloat16", mixed, 16, 512),
        ("G8 P32 bf16 decode split-K", 64, 8, 128, 32, "bfloat16", [(1, c) for c in (2047, 5, 900, 1500)], 8, 16),
        ("G8 P64 H256 bf16 mixed", 8, 1, 256, 64, "bfloat16", mixed, 16, 512),
    ]
    if dry:
        small = [(1, 40), (20, 9), (1, 0), (16, 16)]
        cases = [("G4 P16 f32 (dry)", 8, 2, 16, 16, "float32", small, 8, 64),
                 ("G3 P8 bf16 (dry)", 6, 2, 16, 8, "bfloat16", small, 8, 64)]
    out = []
    for name, N, K, H, P, dt, rows, S, T in cases:
        M = -(-max(q + c for q, c in rows) // P)
        NB = S * M + 1
        dtype = jnp.dtype(dt)
        bt, sl, qsl, ns = (jnp.asarray(a) for a in make_batch(rng, rows, T=T, S=S, P=P, M=M, pages_in_pool=NB))
        k = jnp.asarray(rng.standard_normal((1, NB, K, P, H), np.float32), dtype)
        v = jnp.asarray(rng.standard_normal((1, NB, K, P, H), np.float32), dtype)
        q = jnp.asarray(rng.standard_normal((T, N, H), np.float32), dtype)
        scale = H**-0.5
        got = jax.jit(lambda *a, s=scale: paged_attention(*a, sm_scale=s, backend="pallas"))(
            q, k, v, jnp.int32(0), bt, sl, qsl, ns)
        want = jax.jit(lambda *a, s=scale: reference_attention(*a, sm_scale=s))(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), jnp.int32(0), bt, sl, qsl, ns)
        err = float(jnp.abs(got.astype(jnp.float32) - want).max())
        n_real = int(qsl[-1])
        pad_zero = bool(jnp.all(got[n_real:] == 0))
        tol = 2e-2 if dt != "float32" else 1e-4
        out.append({"case": name, "max_abs_err": err, "tolerance": tol, "padding_rows_zero": pad_zero,
                    "ok": err <= tol and pad_zero})
        print(f"  {'ok  ' if out[-1]['ok'] else 'FAIL'} {name}: max |err| {err:.2e} (tol {tol})", flush=True)
    return out


def time_loop(fn, q, args, iters: int, runs: int) -> float:
    """Median seconds per call of fn(q, *args), chained through q inside one jitted loop."""
    import jax

    loop = jax.jit(lambda q, *a: jax.lax.fori_loop(0, iters, lambda i, x: fn(x, *a), q))
    loop(q, *args).block_until_ready()  # compile and warm up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        loop(q, *args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / iters


def copy_bandwidth(dry: bool, iters: int, runs: int) -> float:
    """GB/s of y = x + 1 over a buffer far larger than L2, counting bytes read and written."""
    import jax.numpy as jnp

    n = (1 << 20) if dry else (1 << 29)  # 2 MiB or 1 GiB of bf16
    x = jnp.zeros((n,), jnp.bfloat16)
    dt = time_loop(lambda x: x + 1, x, (), iters, runs)
    return 2 * n * 2 / dt / 1e9


def read_bandwidth(dry: bool, iters: int, runs: int) -> float:
    """GB/s of reading a buffer far larger than L2 once a call (a sum; nothing written back): the
    denominator of a kernel that only reads its KV, where the copy's figure also pays for writes.
    Each call's sum depends on the one before, so XLA cannot hoist it out of the loop."""
    import jax.numpy as jnp

    n = (1 << 20) if dry else (1 << 29)
    x = jnp.ones((n,), jnp.bfloat16)
    acc = jnp.zeros((), jnp.float32)
    dt = time_loop(lambda a, x: a * 0.5 + jnp.sum((x + a.astype(x.dtype)).astype(jnp.float32)), acc, (x,),
                   iters, runs)
    return n * 2 / dt / 1e9


def matmul_peak(dry: bool, iters: int, runs: int) -> float:
    """TFLOP/s of large bf16 matmuls chained inside one jit (each call's input the previous call's
    output, kept bounded by a tanh whose cost is a rounding error beside the n^3 dot)."""
    import jax
    import jax.numpy as jnp

    n = 256 if dry else 8192
    key = jax.random.PRNGKey(3)
    x = jax.random.normal(key, (n, n), jnp.bfloat16)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.float32) / n**0.5).astype(jnp.bfloat16)
    dt = time_loop(lambda x, w: jnp.tanh(x @ w), x, (w,), iters, runs)
    return 2 * n**3 / dt / 1e12


# the card's own figures (its data sheet), beside the measured ones: HBM bandwidth GB/s, dense bf16 TFLOP/s
PUBLISHED = {"NVIDIA H200": (4800, 989), "NVIDIA H100 80GB HBM3": (3350, 989), "NVIDIA H100": (3350, 989),
             "NVIDIA A100-SXM4-80GB": (2039, 312), "NVIDIA A100-SXM4-40GB": (1555, 312)}


def time_kernels(dry: bool, iters: int, runs: int, backends: list[str], deadline: float) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.backends import get as get_backend
    from pallas_kernels.paged_attention import paged_attention

    N, K, H, P, dtype = (32, 8, 128, 16, jnp.bfloat16) if not dry else (8, 2, 16, 16, jnp.float32)
    if dry:
        cases = {"decode B=8 ctx=64": ([(1, 63)] * 8, 16, 8), "mixed T=64 S=8": ([(16, 0), (16, 30)] + [(1, 40)] * 6, 64, 8)}
    else:
        cases = {f"decode B={B} ctx={c}": ([(1, c - 1)] * B, B, B) for B in (64, 256) for c in (512, 2048, 8192)}
        cases["mixed T=2048 S=256"] = ([(256, 0), (256, 512), (256, 1024), (256, 2048)] + [(1, 2047)] * 252, 2048, 256)
        cases["prefill T=2048 (4 x 512)"] = ([(512, 0)] * 4, 2048, 8)
    M_max = max(-(-max(q + c for q, c in rows) // P) for rows, _, _ in cases.values())
    pages = max(sum(-(-(q + c) // P) for q, c in rows) for rows, _, _ in cases.values()) + 1
    key = jax.random.PRNGKey(0)
    k_cache = jax.random.normal(key, (1, pages, K, P, H), dtype)
    v_cache = jax.random.normal(jax.random.fold_in(key, 1), (1, pages, K, P, H), dtype)
    k_cache_t = jnp.swapaxes(k_cache, -1, -2)  # the "xla" backend's K pool: pages [H, P] (kv_cache.py)
    rng = np.random.default_rng(1)
    out = {}
    for name, (rows, T, S) in cases.items():
        bt, sl, qsl, ns = (jnp.asarray(a) for a in make_batch(rng, rows, T=T, S=S, P=P, M=M_max, pages_in_pool=pages))
        q = jax.random.normal(jax.random.fold_in(key, 2), (T, N, H), dtype)
        kv_bytes = int(np.asarray(sl).sum()) * K * H * 2 * jnp.dtype(dtype).itemsize
        res = {"T": T, "S": S, "kv_bytes": kv_bytes}
        for backend in backends:
            if time.perf_counter() > deadline:
                res[backend] = "skipped: time budget spent"
                continue
            def fn(q, kc, vc, bt, sl, qsl, ns, b=backend):
                return paged_attention(q, kc, vc, jnp.int32(0), bt, sl, qsl, ns, sm_scale=H**-0.5, backend=b)

            kc = k_cache_t if get_backend(backend).k_transposed else k_cache
            try:
                dt = time_loop(fn, q, (kc, v_cache, bt, sl, qsl, ns), iters, runs)
                res[backend] = {"ms": round(dt * 1e3, 4), "kv_gb_s": round(kv_bytes / dt / 1e9, 1)}
            except Exception as e:  # noqa: BLE001 - one backend's failure must not hide the others' figures
                res[backend] = f"error: {type(e).__name__}: {str(e)[:300]}"
        out[name] = res
        print(f"  {name}: " + "  ".join(f"{b} {res[b]}" for b in backends), flush=True)
    return out


def phase_kernels(args) -> dict:
    import jax

    deadline = time.perf_counter() + args.phase_budget_s
    res: dict = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
                 "backend": jax.default_backend()}

    def save() -> None:  # after each step, so a phase killed by its time limit still reports
        if args.part:
            Path(args.part).write_text(json.dumps(res))

    print(f"jax {jax.__version__} on {res['devices']}", flush=True)
    res["correctness"] = check_correctness(args.dry_run)
    save()
    res["copy_gb_s"] = round(copy_bandwidth(args.dry_run, args.iters, args.runs), 1)
    res["read_gb_s"] = round(read_bandwidth(args.dry_run, args.iters, args.runs), 1)
    res["matmul_tflop_s"] = round(matmul_peak(args.dry_run, args.iters, args.runs), 2)
    kind = jax.devices()[0].device_kind
    res["device_kind"] = kind
    res["published_gb_s"], res["published_tflop_s"] = PUBLISHED.get(kind, (None, None))
    print(f"  {kind}: copy {res['copy_gb_s']} GB/s (read + write), read {res['read_gb_s']} GB/s, bf16 matmul "
          f"{res['matmul_tflop_s']} TFLOP/s; published {res['published_gb_s']} GB/s, {res['published_tflop_s']} "
          "TFLOP/s", flush=True)
    save()
    res["timings"] = time_kernels(args.dry_run, args.iters, args.runs, args.backends.split(","), deadline)
    for r in res["timings"].values():
        if isinstance(r.get("pallas"), dict):
            gb = r["pallas"]["kv_gb_s"]
            r["pallas"]["fraction_of_copy"] = round(gb / res["copy_gb_s"], 3)
            r["pallas"]["fraction_of_read"] = round(gb / res["read_gb_s"], 3)
            if res["published_gb_s"]:
                r["pallas"]["fraction_of_published"] = round(gb / res["published_gb_s"], 3)
    save()
    return res


# ---------------------------------------------------------------------------------------------------
# model phase
# ---------------------------------------------------------------------------------------------------
def write_model(folder: Path, hf: dict) -> dict:
    """config.json, random float16 safetensors and a word-level tokenizer for every id of the vocab."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    D, F, L = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    N, K, H, V = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"], hf["vocab_size"]
    # Values only need to be finite and varied: tile one random vector (generating 1.2 G normals
    # would take most of a minute), at a different phase for each tensor.
    base = (np.random.default_rng(0).standard_normal(1 << 22, np.float32) * 0.02).astype(np.float16)
    counter = iter(range(1 << 30))

    def rand(*shape):
        off = (next(counter) * 7919) % (1 << 21)
        return np.resize(base[off:], shape)

    t = {"model.embed_tokens.weight": rand(V, D), "model.norm.weight": np.ones(D, np.float16)}
    for i in range(L):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": rand(N * H, D), p + "self_attn.k_proj.weight": rand(K * H, D),
              p + "self_attn.v_proj.weight": rand(K * H, D), p + "self_attn.o_proj.weight": rand(D, N * H),
              p + "mlp.gate_proj.weight": rand(F, D), p + "mlp.up_proj.weight": rand(F, D),
              p + "mlp.down_proj.weight": rand(D, F), p + "input_layernorm.weight": np.ones(D, np.float16),
              p + "post_attention_layernorm.weight": np.ones(D, np.float16)}
    if not hf["tie_word_embeddings"]:
        t["lm_head.weight"] = rand(V, D)
    save_file(t, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
              "bos_token_id": V - 2, "eos_token_id": V - 1, "torch_dtype": "float16", **hf}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"t{i}": i for i in range(V - 2)} | {"<bos>": V - 2, "<eos>": V - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="t0",
                            pad_token="t0").save_pretrained(str(folder))
    return {"folder": str(folder), "params_m": round(sum(a.size for a in t.values()) / 1e6, 1)}


# ---------------------------------------------------------------------------------------------------
# orchestration
# ---------------------------------------------------------------------------------------------------
def run_phase(argv: list[str], timeout: float, env: dict) -> tuple[dict | None, str]:
    """Run a subprocess; return the JSON of its last stdout line that is one, and a status."""
    try:
        p = subprocess.run(argv, cwd=ROOT, env=env, timeout=max(timeout, 1), capture_output=True, text=True,
                           check=False)  # a failed phase is reported, the others still run
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-2000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-2000:]
        print(tail, flush=True)
        return None, f"timed out after {timeout:.0f} s"
    print(p.stdout[-4000:], flush=True)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line), "ok" if p.returncode == 0 else f"exit {p.returncode}"
            except json.JSONDecodeError:
                continue
    return None, f"exit {p.returncode}: {p.stderr.strip()[-1500:]}"


# Each phase's share of --budget-s (its limit; a phase that ends early leaves its time to the later
# ones, which never get more than is left). In the order they run: most wanted first.
SHARES = {"model": 0.1, "traced": 0.3, "unrolled": 0.25, "sampler_branches": 0.15, "other_backend": 0.15,
          "tp2": 0.15, "sampler": 0.1, "kernels": 0.4}


def device_count(env: dict) -> int:
    """jax's device count, asked in a subprocess (this process never initialises jax)."""
    p = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"], env=env, capture_output=True,
                       text=True, timeout=120, check=False)
    return int(p.stdout.strip() or 0) if p.returncode == 0 else 0


def orchestrate(args) -> int:
    t_start = time.perf_counter()
    out_path = Path(args.out or os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"dry_run": args.dry_run, "phases": {}}

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    def save() -> None:
        report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        out_path.write_text(json.dumps(report, indent=1))

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--iters", str(args.iters), "--runs", str(args.runs), "--backends", args.backends] + (
        ["--dry-run"] if args.dry_run else [])

    def budget(share: float, floor: float = 30.0) -> float:
        """A phase's limit: its share of the whole budget (at least `floor`), never more than is left.
        Phases run in order of value, so a cut falls on the least needed figures."""
        return max(0.0, min(left(), max(share * args.budget_s, floor)))

    def kernels() -> None:
        print("== kernels: correctness, copy bandwidth, timings", flush=True)
        limit = min(args.kernels_s, budget(SHARES["kernels"]), left() - 5)
        part = out_path.with_suffix(".kernels.part.json")
        res, status = run_phase(me + ["--phase", "kernels", "--phase-budget-s", str(max(limit - 20, 10)), "--part",
                                      str(part)] + common, limit, env)
        if res is None and part.is_file():  # timed out or crashed: keep what it had measured
            res = json.loads(part.read_text())
        part.unlink(missing_ok=True)
        report["phases"]["kernels"] = status
        report["kernels"] = res
        save()

    print("== model: random-weight checkpoint", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / ("llama-tiny" if args.dry_run else "llama-1b-random")
        res, status = run_phase(me + ["--phase", "model", "--model-dir", str(folder)] + common,
                                budget(SHARES["model"]), env)
        report["phases"]["model"] = status
        report["model"] = res
        save()
        report["bench"] = {}
        if res is not None:
            bench = [sys.executable, str(ROOT / "scripts" / "bench_offline.py"), "--model", str(folder), "--json"]
            bench += (["--dtype", "float32", "-n", "4", "--min-prompt", "4", "--max-prompt", "24", "--min-output", "2",
                       "--max-output", "6", "--max-num-seqs", "4",
                       "--max-num-batched-tokens", "32", "--max-model-len", "64"] if args.dry_run else
                      ["--dtype", "bfloat16", "-n", str(args.requests), "--max-num-seqs", "64",
                       "--max-num-batched-tokens", "512", "--max-model-len", "1024"])
            backends = args.backends.split(",")
            first = backends[0]
            # (report key, attention backend, extra flags, budget share), in order of value. First the
            # open question: the first backend without, then with overlapped scheduling (the device's
            # idle share without it, the host's share of a step with it) and one more run under a
            # profiler trace (the device's busy time per step as the device saw it; the host's
            # timings only say how long it was blocked). Then the layers unrolled in the program
            # (layers.py: no scan slicing stacked weights, no per-layer switch; a longer warm-up): the
            # platform record keeps "stacked" on GPUs until this says otherwise. Then, with overlap
            # on, the sampler as the other platform's choice (sampler_branches "device": lax.conds
            # whose predicates XLA:GPU reads back to the host) against the first run's "host". The
            # other backends, whose figures are known, come after; the kernel matrix last.
            other = "host" if args.dry_run else "device"  # the dry run's CPU default is "device"
            runs = [(first, first, ["--overlap", "both", "--trace-dir", str(Path(tmp) / "trace")], SHARES["traced"]),
                    (f"{first}_unrolled", first, ["--engine-arg", "layer_weights=unrolled"], SHARES["unrolled"]),
                    (f"{first}_sampler_{other}", first, ["--overlap", "on", "--engine-arg",
                                                         f"sampler_branches={other}"], SHARES["sampler_branches"])]
            runs += [(b, b, [], SHARES["other_backend"]) for b in backends[1:]]
            for key, backend, extra, share in runs:
                shown = [x for x in extra if not x.startswith(tmp)]  # not the trace folder
                print(f"== bench {key}: attention_backend={backend} {' '.join(shown)}", flush=True)
                r, status = run_phase(bench + ["--engine-arg", f"attention_backend={backend}"] + extra, budget(share),
                                      env)
                report["phases"][f"bench_{key}"] = status
                report["bench"][key] = r
                save()
            # Tensor parallelism needs a second GPU: run it where there is one, say so where not.
            devices = device_count(env)
            if devices > 1:
                print("== bench: tensor_parallel_size=2 (pallas)", flush=True)
                r, status = run_phase(bench + ["--engine-arg", "attention_backend=pallas", "--engine-arg",
                                               "tensor_parallel_size=2"], budget(SHARES["tp2"]), env)
                report["phases"]["bench_tp2"] = status
                report["bench"]["pallas_tp2"] = r
            else:
                print(f"== bench: tensor_parallel_size=2 skipped: {devices} device(s) here, it needs 2", flush=True)
                report["bench"]["pallas_tp2"] = f"skipped: {devices} device(s), tensor parallelism needs 2"
            save()
    # The sampler's cond-free programs alone (the GPU's choice), greedy rows: what the filters' sort
    # over [S, V] costs beside the step, and so whether each variant earns its compile at warm-up.
    print("== sampler variants: ms per call", flush=True)
    sampler = [sys.executable, str(ROOT / "scripts" / "bench_sampler.py"), "--variants", "--json"] + (
        ["--vocab", "1000", "--seqs", "8", "--reps", "3"] if args.dry_run else
        ["--vocab", str(LLAMA_1B["vocab_size"]), "--seqs", "64", "256", "--reps", "20"])
    res, status = run_phase(sampler, budget(SHARES["sampler"]), env)
    report["phases"]["sampler"] = status
    report["sampler_variants"] = res
    save()
    # Last: the kernel matrix, measured on the H200 already (docs/PERFORMANCE.md, "GPU (H200)");
    # its correctness cases still decide "OK".
    kernels()
    ok = all(s == "ok" for s in report["phases"].values()) and all(
        c["ok"] for c in (report.get("kernels") or {}).get("correctness", [{"ok": False}]))
    report["ok"] = ok
    save()
    print(f"== {'OK' if ok else 'NOT OK'}: {out_path} ({report['elapsed_s']} s)", flush=True)
    return 0 if ok else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON path (default $OUT/gpu_check.json, else ./gpu_check.json)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (interpret mode)")
    ap.add_argument("--budget-s", type=float, default=470, help="total time for all phases")
    ap.add_argument("--kernels-s", type=float, default=200, help="time limit of the kernels phase")
    ap.add_argument("--iters", type=int, default=20, help="calls per timed loop")
    ap.add_argument("--runs", type=int, default=7, help="timed loops per figure (median)")
    ap.add_argument("--requests", type=int, default=128, help="requests of the engine benchmark")
    ap.add_argument("--backends", default="pallas,xla")
    ap.add_argument("--phase", choices=["kernels", "model"], help=argparse.SUPPRESS)
    ap.add_argument("--phase-budget-s", type=float, default=180, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dry_run:
        args.iters, args.runs = min(args.iters, 2), min(args.runs, 2)
    if args.phase == "kernels":
        print(json.dumps(phase_kernels(args)))
    elif args.phase == "model":
        print(json.dumps(write_model(Path(args.model_dir), LLAMA_TINY if args.dry_run else LLAMA_1B)))
    else:
        sys.exit(orchestrate(args))


if __name__ == "__main__":
    main()
