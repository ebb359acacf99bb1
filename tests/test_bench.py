"""`jaxsched bench`: each command end to end on the tiny model with small sizes, its JSON fields and
the sanity checks a broken measurement would fail (tokens counted as asked, static batching needing
more steps than continuous on a long tail, one set of metrics per priority class, plots written)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from servers import uvicorn_thread

from jaxsched import LLM
from jaxsched.bench import main as bench_main
from jaxsched.bench import serve, workloads
from serving.app import build_app
from serving.async_engine import AsyncEngine
from serving.grpc_server import GrpcFrontEnd

pytest.importorskip("matplotlib")  # the `test` extra installs it: --plot is part of every smoke test

ENGINE = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 8}
ENGINE_FLAGS = [f for k, v in ENGINE.items() for f in ("--" + k.replace("_", "-"), str(v))]
SMALL = ["--min-prompt", "4", "--max-prompt", "12", "--min-output", "2", "--max-output", "6"]


def run_bench(argv: list[str], capsys) -> list[dict]:
    """Run `jaxsched bench ARGV --json`; the JSON lines it printed."""
    assert bench_main(["--log-level", "WARNING", *argv, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_throughput_continuous_vs_static(llama_dir, tmp_path, capsys):
    out = tmp_path / "tp.json"
    [res] = run_bench(["throughput", llama_dir, *ENGINE_FLAGS, "--workload", "long-tail", "-n", "16", *SMALL,
                       "--batching", "both", "--overlap", "both", "--output-json", str(out),
                       "--plot", str(tmp_path / "plots")], capsys)
    assert json.loads(out.read_text()) == res
    asked = res["workload"]["requested_output_tokens"]
    assert res["workload"]["name"] == "long-tail" and res["workload"]["num_requests"] == 16
    runs = {(r["batching"], r["overlap"]): r for r in res["runs"]}
    assert set(runs) == {(b, o) for b in ("continuous", "static") for o in ("off", "on")}
    for r in runs.values():
        for k in ("request_throughput", "output_throughput", "total_token_throughput", "padded_tokens_per_step",
                  "peak_kv_cache_usage_perc", "num_preemptions", "idle_seat_steps", "idle_seat_share",
                  "wall_ms_per_step", "host_ms_per_step", "device_wait_ms_per_step"):
            assert isinstance(r[k], (int, float)), k
        assert r["num_requests"] == 16 and r["total_output_tokens"] == asked  # ignore_eos: exactly as asked
        assert r["total_input_tokens"] == res["workload"]["prompt_tokens"]
        assert 0 < r["peak_kv_cache_usage_perc"] <= 1 and r["output_throughput"] > 0
        assert r["seats"] == 4
        assert 0 < r["mean_kv_internal_waste_perc"] < 1  # partly filled last blocks while requests run
        phases = r["host_ms_per_step_by_phase"]
        assert set(phases) == {"schedule", "pack", "launch", "update", "output"}
        # launching (dispatching the step's programs) is host work inside the step's wall time
        assert 0 < phases["launch"] < r["wall_ms_per_step"]
        assert 0 < r["scheduling_share"] < 1
    for o in ("off", "on"):  # a static batch waits for its longest request: more steps, more idle seats
        c, s = runs[("continuous", o)], runs[("static", o)]
        assert s["num_steps"] >= c["num_steps"]
        assert s["idle_seat_share"] > c["idle_seat_share"]
    assert "device_idle_share" in runs[("continuous", "off")]
    assert (res["batching"], res["overlap"]) == ("continuous", "on")  # the top level is the primary run
    assert res["continuous_over_static"]["num_steps"] >= 1.0
    assert res["overlap_speedup"] > 0 and "host_share_with_overlap" in res
    assert png(tmp_path / "plots" / "throughput_batching.png")


def test_throughput_stops_at_max_steps(llama_dir, capsys):
    """--max-steps: the run measures that many steps with the workload queued, then aborts the rest
    (none is left in the engine for the next run)."""
    [res] = run_bench(["throughput", llama_dir, *ENGINE_FLAGS, "-n", "24", *SMALL, "--max-steps", "3",
                       "--batching", "both"], capsys)
    for r in res["runs"]:
        assert 3 <= r["num_steps"] <= 4 and r["num_requests"] < 24  # a step in flight may be read after
        assert r["total_output_tokens"] < res["workload"]["requested_output_tokens"]
        assert 0 < r["scheduling_share"] < 1


def test_throughput_copy_workload_with_and_without_speculation(llama_dir, capsys):
    """--workload copy (chat prompts asking for a passage back, ended by EOS) and --speculation both:
    one run without proposals, one with, on the same engine; the same greedy tokens come out, the
    run with them reports its proposals (vLLM's spec_decode names) and the ratio."""
    flags = ["--max-model-len", "320", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--block-size", "8",
             "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    [res] = run_bench(["throughput", llama_dir, *flags, "--workload", "copy", "-n", "6", "--min-prompt", "20",
                       "--max-prompt", "60", "--max-output", "8", "--speculation", "both"], capsys)
    assert res["workload"]["name"] == "copy"
    runs = {r["speculation"]: r for r in res["runs"]}
    assert set(runs) == {"on", "off"}
    on, off = runs["on"], runs["off"]
    assert on["total_output_tokens"] == off["total_output_tokens"] > 0  # greedy: the same tokens either way
    assert off["spec_decode"]["num_drafts"] == 0 and off["spec_decode"]["acceptance_rate"] is None
    sd = on["spec_decode"]
    assert sd["num_drafts"] > 0 and 0 <= sd["num_accepted_tokens"] <= sd["num_draft_tokens"]
    assert sd["mean_accepted_length"] == round(1 + sd["num_accepted_tokens"] / sd["num_drafts"], 3)
    assert list(res["speculation_speedup"]) == ["continuous/overlap off/0"] and res["speculation"] == "on"
    assert bench_main(["--log-level", "WARNING", "throughput", llama_dir, *ENGINE_FLAGS, "-n", "2", *SMALL,
                       "--speculation", "on"]) == 2
    assert "--speculation needs --speculative-config" in capsys.readouterr().err


def test_latency(llama_dir, tmp_path, capsys):
    [res] = run_bench(["latency", llama_dir, *ENGINE_FLAGS, "--batch-size", "4", "--input-len", "40",
                       "--output-len", "6", "--num-iters", "2", "--no-async-scheduling",
                       "--plot", str(tmp_path)], capsys)
    assert res["batch_size"] == 4 and res["num_iters"] == 2 and len(res["latencies"]) == 2
    assert set(res["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    # 160 prompt tokens, 32 per step (shared with the decodes of requests already prefilled): at least
    # 5 steps until every request has its first token, then the last one's 5 other tokens
    assert res["prefill_steps"] >= 5 and res["decode_steps"] == 5
    assert 0 < res["mean_prefill_ms"] < res["avg_latency"] * 1e3
    assert res["mean_decode_step_ms"] > 0 and res["decode_tokens_per_s"] > 0
    assert png(tmp_path / "latency_steps.png")


def test_scheduler_through_the_cli(tmp_path, capsys):
    from serving.cli import main as cli_main

    out = tmp_path / "s.json"
    assert cli_main(["--log-level", "WARNING", "bench", "scheduler", "--sizes", "16", "64", "--max-num-seqs", "8",
                     "--max-num-batched-tokens", "256", "--prompt-len", "16", "--max-tokens", "8",
                     "--output-json", str(out), "--plot", str(tmp_path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert json.loads(out.read_text()) == res
    assert [r["R"] for r in res["results"]] == [16, 64]
    for r in res["results"]:
        assert r["finished"] and 0 < r["step_us_p50"] <= r["step_us_p99"]
        assert abs(r["schedule_share"] + r["pack_share"] + r["update_share"] - 1) < 0.01
    assert png(tmp_path / "scheduler_steps.png")


def test_bench_scripts_stay_wrappers(monkeypatch, capsys):
    """bench_offline.py keeps what bench_steps.py / bench_vs_vllm.py import; bench_scheduler.py its
    --R flag and its JSON lines."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import bench_offline
    import bench_scheduler

    args = bench_offline.parser("x").parse_args(["-n", "5", "--min-prompt", "3", "--max-prompt", "7"])
    prompts, params, plens, olens = bench_offline.workload(args, 300)
    assert [len(p["prompt_token_ids"]) for p in prompts] == plens.tolist()
    assert [p.max_tokens for p in params] == olens.tolist() and all(p.ignore_eos for p in params)
    # the engine as the jaxsched commands build it (cpu_reserved_cores "auto"), built as it is
    # measured (so that "auto" decides for that engine); "auto" leaves overlap to the engine
    made = []
    monkeypatch.setattr("jaxsched.LLM", lambda model, **kw: made.append(kw))
    for overlap in ("auto", "on", "off", "both", None):  # None: bench_steps.py's and bench_vs_vllm.py's, no flag
        ns = bench_offline.parser("x").parse_args([])
        if overlap is not None:
            ns.overlap = overlap
        bench_offline.make_llm(ns)
    assert [(kw["cpu_reserved_cores"], kw.get("async_scheduling")) for kw in made] == [
        ("auto", None), ("auto", True), ("auto", False), ("auto", True), ("auto", None)]
    bench_offline.make_llm(bench_offline.parser("x").parse_args(["--engine-arg", "cpu_reserved_cores=0"]))
    assert made[-1]["cpu_reserved_cores"] == 0
    # `jaxsched bench throughput` builds its engine the same way (an explicit flag wins)
    from jaxsched.bench import throughput

    built = []

    class Built(Exception):
        pass

    def build(ns):
        built.append(ns.async_scheduling)
        raise Built

    monkeypatch.setattr(throughput, "build_engine", build)
    p = argparse.ArgumentParser()
    throughput.add_arguments(p)
    for flags in ([], ["--overlap", "on"], ["--overlap", "off"], ["--overlap", "both"],
                  ["--overlap", "off", "--async-scheduling"]):
        with pytest.raises(Built):
            throughput.main(p.parse_args(flags))
    assert built == [None, True, False, True, True]
    monkeypatch.setattr(sys, "argv", ["bench_scheduler.py", "--R", "8", "--prompt-len", "8", "--max-tokens", "4"])
    bench_scheduler.main()
    line = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert line["R"] == 8 and {"step_us_p50", "step_us_p99"} <= set(line)


def test_bench_offline_overlap_both_reports_the_idle_share(llama_dir, monkeypatch, capsys, tmp_path):
    """bench_offline.py --overlap both (what gpu_check.py runs on the GPU): the JSON has the device's
    idle share of the synchronous run beside the host's share of a step with overlap and the speedup,
    and the printed summary says both."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import bench_offline

    flags = ["--model", llama_dir, "-n", "4", *SMALL, "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
             "--max-model-len", "128", "--engine-arg", "block_size=8", "--engine-arg", "warm_up_runs=false",
             "--overlap", "both", "--json", "--trace-dir", str(tmp_path / "trace")]
    monkeypatch.setattr(sys, "argv", ["bench_offline.py", *flags])
    bench_offline.main()
    out = capsys.readouterr().out
    res = json.loads(out.splitlines()[-1])
    assert res["overlap"] == "on" and res["layer_weights"] == "per_layer"  # the CPU's choice under "auto"
    assert 0 <= res["device_idle_share"] < 1 and 0 <= res["host_share_with_overlap"] < 1
    assert res["overlap_speedup"] > 0 and res["off_output_tokens_per_s"] > 0
    assert "without overlap the device idles" in out and "with overlap the host's share" in out
    # the device-only time (the device's busy time per step without overlap, first runs of a
    # program left out) and the host's share measured against it and against the host's wait alone
    assert res["off_device_busy_ms_per_step"] > 0 and "(the device-only time)" in out
    assert 0 <= res["host_share_with_overlap_by_wait"] < 1
    # where the host's time goes, for both runs (on a GPU, the launch phase bounds the step)
    for key in ("host_ms_per_step_by_phase", "off_host_ms_per_step_by_phase"):
        assert set(res[key]) == {"schedule", "pack", "launch", "update", "output"} and res[key]["launch"] > 0
    assert "host ms per step    schedule" in out
    # the traced extra run: a CPU trace has no device plane, so no busy figure, but the host's regions
    assert res["trace"]["device_busy_ms_per_step"] is None and "device_busy_share" not in res
    assert res["trace"]["top_host_ms_per_step"] and res["trace"]["file"].startswith(str(tmp_path))
    assert "trace               no device plane" in out


@pytest.mark.slow
def test_bench_vs_vllm_rounds_keep_the_child_and_time_each_round(llama_dir, monkeypatch, capsys):
    """bench_vs_vllm.py --rounds (jaxsched alone: vLLM is not installed here): one resident child
    builds its engine once and times the same requests once per round, its prefix cache emptied
    before each (a cached repeat would find its prompts and skip them); the table gives each round
    and the medians."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import bench_vs_vllm

    flags = ["--model", llama_dir, "--engines", "jaxsched", "--rounds", "3", "-n", "3", *SMALL,
             *ENGINE_FLAGS[:6], "--engine-arg", "block_size=8", "--engine-arg", "warm_up_runs=false", "--json"]
    monkeypatch.setattr(sys, "argv", ["bench_vs_vllm.py", *flags])
    bench_vs_vllm.main()
    out = capsys.readouterr().out
    res = json.loads(out.splitlines()[-1])
    runs = res["runs"]["jaxsched"]
    assert len(runs) == 3 and all(r["output_tokens"] == res["output_tokens"] for r in runs)
    # every prompt token computed each round (a request's last output token is never fed back)
    assert [r["scheduled_tokens"] for r in runs] == [res["prompt_tokens"] + res["output_tokens"] - 3] * 3
    assert [r["prefix_cache_hits"] for r in runs] == [0, 0, 0]
    assert {r["init_s"] for r in runs} == {runs[0]["init_s"]}  # one engine
    assert res["jaxsched"]["elapsed_s"] == sorted(r["elapsed_s"] for r in runs)[1]  # the median
    assert [line.split()[:2] for line in out.splitlines() if line.startswith("round ")] == [
        ["round", "1"], ["round", "2"], ["round", "3"]]


def test_bench_vs_vllm_served_rounds_alternate_both_servers(monkeypatch, capsys):
    """--serve --rounds: both servers started once (one at a time, on port and port + 1), then measured
    in turns A B, B A, A B with one seed per round shared by both engines; the table gives each
    round's ratio and the medians. The servers here are stand-ins: vLLM's client is not installed."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import bench_vs_vllm

    events = []

    class FakeServer:
        def __init__(self, args, which, port):
            events.append(("start", which, port))
            self.which = which

        def bench(self, seed):
            events.append(("bench", self.which, seed))
            tok_s = {"jaxsched": 120.0, "vllm": 100.0}[self.which] + seed  # a ratio per round
            return {"engine": self.which, "output_tokens_per_s": tok_s, "mean_ttft_ms": 1000.0 + seed,
                    "server_ready_s": 1.0}

        def close(self):
            events.append(("close", self.which))

    args = bench_vs_vllm.offline_parser("x").parse_args(["--model", "m", "--seed", "7"])
    vars(args).update(engines=["jaxsched", "vllm"], rounds=3, port=9000, num_prompts=4, random_input_len=8,
                      random_output_len=2)
    res = bench_vs_vllm.served(args, start=FakeServer)
    assert events[:2] == [("start", "jaxsched", 9000), ("start", "vllm", 9001)]
    assert [e[1:] for e in events[2:8]] == [("jaxsched", 7), ("vllm", 7), ("vllm", 8), ("jaxsched", 8),
                                            ("jaxsched", 9), ("vllm", 9)]
    assert sorted(e[1] for e in events[8:]) == ["jaxsched", "vllm"] and all(e[0] == "close" for e in events[8:])
    assert res["round_ratios"] == [round(127 / 107, 3), round(128 / 108, 3), round(129 / 109, 3)]
    assert res["jaxsched"]["output_tokens_per_s"] == 128.0 and res["vllm"]["mean_ttft_ms"] == 1008.0  # medians
    out = capsys.readouterr().out
    assert [line.split()[:2] for line in out.splitlines() if line.startswith("round ")] == [
        ["round", "1"], ["round", "2"], ["round", "3"]]

    # one round: one server up at a time, both on the same port, each closed before the next starts
    events.clear()
    args.rounds = 1
    res = bench_vs_vllm.served(args, start=FakeServer)
    assert events == [("start", "jaxsched", 9000), ("bench", "jaxsched", 7), ("close", "jaxsched"),
                      ("start", "vllm", 9000), ("bench", "vllm", 7), ("close", "vllm")]
    assert res["ratio_output_tok_s"] == round(127 / 107, 3) and "round_ratios" not in res
    monkeypatch.setattr(sys, "argv", ["bench_vs_vllm.py", "--model", "m", "--serve", "--rounds", "0"])
    with pytest.raises(SystemExit):
        bench_vs_vllm.main()
    assert "--rounds 0: give a count of 1 or more" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert bench_main(["scheduler", "--sizes", "8", "--plot", str(tmp_path)]) == 2
    assert "pip install 'jaxsched[plot]'" in capsys.readouterr().err


# -- workloads --------------------------------------------------------------------------------
def ns_of(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    workloads.add_workload_arguments(p)
    ns = p.parse_args([])
    ns.seed = 0
    vars(ns).update(kw)
    return ns


def test_long_tail_workload():
    reqs = workloads.synthetic(ns_of(workload="long-tail", num_requests=40), vocab_size=300)
    short = [r.output_len for r in reqs if r.output_len <= 64]
    long = [r.output_len for r in reqs if r.output_len > 64]
    assert len(long) == 4 and all(160 <= o <= 640 and o % 10 == 0 for o in long)  # 10 % of them, 10x
    assert len(short) == 36 and all(16 <= o <= 64 for o in short)
    assert all(16 <= r.prompt_len <= 128 and len(r.prompt) == r.prompt_len for r in reqs)
    text = workloads.synthetic(ns_of(num_requests=3, max_prompt=20), vocab_size=None)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == r.prompt_len for r in text)


def test_datasets(tmp_path, tokenizer_dir):
    from jaxsched.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "hello world", "max_tokens": 5}\n\n{"prompt": [5, 6, 7], "max_tokens": 3}\n')
    reqs = workloads.load_dataset(str(jsonl), None, 0, tok, None, None)
    assert [(r.prompt, r.output_len) for r in reqs] == [("hello world", 5), ([5, 6, 7], 3)]
    assert reqs[1].prompt_len == 3
    assert [r.output_len for r in workloads.load_dataset(str(jsonl), 1, 0, None, 9, None)] == [9]
    share = tmp_path / "sharegpt.json"
    conv = [{"conversations": [{"from": "human", "value": f"what is a cat ? {i}"},
                               {"from": "gpt", "value": "dogs and cats like to play in the sun . " * (i + 1)}]}
            for i in range(5)] + [{"conversations": [{"from": "human", "value": "one turn only"}]}]
    share.write_text(json.dumps(conv))
    reqs = workloads.load_dataset(str(share), 3, 0, tok, None, None)
    assert len(reqs) == 3 and all(r.prompt.startswith("what is a cat") and r.output_len >= 4 for r in reqs)
    with pytest.raises(ValueError, match="--tokenizer"):
        workloads.load_dataset(str(share), 3, 0, None, None, None)
    with pytest.raises(ValueError, match="no usable requests"):
        workloads.load_dataset(str(share), 3, 0, tok, None, 4)  # nothing fits max_model_len 4


def test_priority_field_and_classes():
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    req = workloads.BenchRequest("hi", 4)
    base = ["--endpoint", "/v1/chat/completions"]
    on = p.parse_args([*base, "--priority-share", "0.5"])
    assert serve.request_body(on, "m", req, "high")["priority"] == -10
    assert serve.request_body(on, "m", req, "normal")["priority"] == 0
    body = serve.request_body(on, "m", req, "high")
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_completion_tokens"] == 4
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    for args in (["--priority-share", "0.5", "--no-priority-field"], []):  # fcfs servers: no field at all
        assert "priority" not in serve.request_body(p.parse_args(args), "m", req, "high")
    classes = serve.classes_of(20, 0.2, seed=3)
    assert classes.count("high") == 4 and classes == serve.classes_of(20, 0.2, seed=3)
    a1, a2 = serve.arrival_times(50, 2.0, 0), serve.arrival_times(50, 4.0, 0)
    assert a1[0] == 0 and (a1 == 2 * a2).all() and 15 < a1[-1] < 35  # the same arrivals, scaled


# -- serve, against this server ---------------------------------------------------------------
@pytest.fixture(scope="module")
def served(llama_dir):
    """(HTTP URL, gRPC target) of one server, as `jaxsched serve --grpc-port` runs them."""
    engine = AsyncEngine(LLM(llama_dir, scheduling_policy="priority", **ENGINE).llm_engine)
    app = build_app(engine, served_model_name="tiny")
    front = GrpcFrontEnd(app, 0)
    with uvicorn_thread(app, engine, (front,)) as url:
        yield url, front.target
    engine.shutdown()


@pytest.fixture(scope="module")
def server_url(served):
    return served[0]


METRICS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p90", "p99")]


def test_serve_priority_classes_sweep_and_plots(server_url, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    lines = run_bench(["serve", "--base-url", server_url, "-n", "12", *SMALL, "--priority-share", "0.25",
                       "--sweep", "40,inf", "--goodput", "ttft:60000", "e2el:60000", "--label", "priority",
                       "--output-json", str(out), "--plot", str(tmp_path)], capsys)
    saved = json.loads(out.read_text())
    assert [r["request_rate"] for r in saved["sweep"]] == [40.0, "inf"] and len(lines) == 2
    for res, full in zip(lines, saved["sweep"]):
        assert res["model"] == "tiny" and res["completed"] == 12 and res["failed"] == 0 and res["errors"] == {}
        assert res["total_output_tokens"] == res["workload"]["requested_output_tokens"]  # ignore_eos
        assert res["total_input_tokens"] > 0 and res["request_goodput"] > 0 and res["goodput_requests"] == 12
        for k in METRICS + ["request_throughput", "output_throughput", "total_token_throughput"]:
            assert isinstance(res[k], (int, float)), k
        assert res["median_ttft_ms"] <= res["p99_ttft_ms"] <= res["p99_e2el_ms"] + 1e-6
        assert res["priority"]["field_sent"] is True
        classes = res["classes"]
        assert classes["high"]["completed"] == 3 and classes["normal"]["completed"] == 9
        # a class's inter-token gaps may be none at all: when the stream's reader falls behind, the
        # server sends what waits as one chunk, and a class of 3 short answers can come whole
        assert all(isinstance(classes[c][k], float) for c in classes for k in METRICS if "_ttft_" in k or "_e2el_" in k)
        assert all(isinstance(classes[c][k], (float, type(None))) for c in classes for k in METRICS if "_itl_" in k)
        assert "ttfts" not in res and len(full["ttfts"]) == 12 and full["request_classes"].count("high") == 3
    for name in ("serve_latency_cdf_rate40.0.png", "serve_latency_cdf_rateinf.png", "serve_sweep.png"):
        assert png(tmp_path / name), name


def test_serve_chat_dataset_errors_and_compare(server_url, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "max_tokens": m}) + "\n" for p, m in
                            [("what is a cat ?", 5), ("hello world", 4), ("one two three", 1000), ("the sun", 3)]))
    first = tmp_path / "fcfs.json"
    common = ["serve", "--base-url", server_url, "--endpoint", "/v1/chat/completions", "--dataset", str(data),
              "--num-warmups", "0", "--max-concurrency", "2", "--priority-share", "0.5"]
    [res] = run_bench([*common, "--no-priority-field", "--label", "fcfs", "--output-json", str(first)], capsys)
    assert res["completed"] == 3 and res["failed"] == 1 and res["max_concurrent_requests"] <= 2
    [(msg, n)] = res["errors"].items()
    assert n == 1 and msg.startswith("HTTP 400") and "maximum context length" in msg
    assert res["total_output_tokens"] == 5 + 4 + 3
    assert res["priority"]["field_sent"] is False and set(res["classes"]) == {"high", "normal"}
    [res2] = run_bench([*common, "--label", "priority", "--compare", str(first), "--plot", str(tmp_path)], capsys)
    assert res2["completed"] == 3 and res2["priority"]["field_sent"] is True
    assert png(tmp_path / "serve_latency_cdf.png")


def test_serve_refuses_clearly(server_url, capsys):
    """A wrong model name fails the warm-up request, an unreachable server the first call: exit 2
    with the reason, not a traceback, and no half-run benchmark."""
    assert bench_main(["serve", "--base-url", server_url, "--model", "nope", "-n", "2"]) == 2
    assert "warm-up request" in (err := capsys.readouterr().err) and "does not exist" in err
    assert bench_main(["serve", "--base-url", "http://127.0.0.1:1", "-n", "2"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err


def test_serve_over_grpc_measures_the_same_requests(served, capsys):
    url, target = served
    # outputs of 16+ tokens: a stream read by a client that falls behind (a busy machine) comes
    # out coalesced, and a request whose tokens all arrive in one message has no inter-token
    # latency; with 2-6 tokens, all 12 could (mean_itl_ms None on a loaded CI run)
    common = ["serve", "-n", "12", *SMALL[:4], "--min-output", "16", "--max-output", "24", "--priority-share", "0.25",
              "--goodput", "ttft:60000"]
    [http] = run_bench([*common, "--base-url", url], capsys)
    [grpc] = run_bench([*common, "--grpc", target], capsys)
    assert (grpc["backend"], grpc["endpoint"], grpc["model"]) == ("grpc", "Generate", "tiny")
    assert grpc["completed"] == 12 and grpc["failed"] == 0 and grpc["errors"] == {}
    for k in ("total_input_tokens", "total_output_tokens", "workload"):
        assert grpc[k] == http[k], k  # the same requests, counted by the server the same way
    assert grpc["total_output_tokens"] == grpc["workload"]["requested_output_tokens"]
    assert grpc["classes"]["high"]["completed"] == 3 and grpc["goodput_requests"] == 12
    for k in METRICS:
        assert isinstance(grpc[k], float), k
    # what gRPC cannot send is refused before any request, saying why
    assert bench_main(["serve", "--grpc", target, "--endpoint", "/v1/chat/completions", "-n", "2"]) == 2
    assert "--grpc sends completions" in capsys.readouterr().err
    assert bench_main(["serve", "--grpc", target, "-n", "2", "--extra-body", '{"best_of": 2}']) == 2
    assert "no gRPC sampling_params field for best_of" in capsys.readouterr().err
    assert bench_main(["serve", "--grpc", target, "-n", "2", "--extra-body", '{"top_k": "x"}']) == 2
    assert "does not fit jaxsched.proto" in capsys.readouterr().err
    # HTTP's spellings of logit_bias and structured_outputs are carried over
    req = serve.grpc_request({"prompt": [1, 2], "logit_bias": {"7": -5.0}, "stop": "x",
                              "structured_outputs": {"choice": ["a", "b"]}, "priority": 2})
    assert (dict(req.sampling_params.logit_bias), list(req.sampling_params.stop), req.priority) == ({7: -5.0}, ["x"], 2)
    assert list(req.sampling_params.structured_outputs.choice.choices) == ["a", "b"]
    assert bench_main(["serve", "--grpc", "127.0.0.1:1", "-n", "2"]) == 2
    assert "cannot reach the gRPC server" in capsys.readouterr().err


def test_bench_offline_keeps_its_figures_when_the_profiler_fails(llama_dir, monkeypatch, capsys, tmp_path):
    """The profiler raising (as when CUPTI cannot load on a GPU) costs the trace, not the run's figures."""
    import jax

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import bench_offline

    def broken(*a, **k):
        raise RuntimeError("CUPTI could not be loaded")

    monkeypatch.setattr(jax.profiler, "trace", broken)
    flags = ["--model", llama_dir, "-n", "4", *SMALL, "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
             "--max-model-len", "128", "--engine-arg", "block_size=8", "--engine-arg", "warm_up_runs=false",
             "--overlap", "both", "--json", "--trace-dir", str(tmp_path / "trace")]
    monkeypatch.setattr(sys, "argv", ["bench_offline.py", *flags])
    bench_offline.main()
    out = capsys.readouterr().out
    res = json.loads(out.splitlines()[-1])
    assert res["trace"] == {"error": "RuntimeError: CUPTI could not be loaded"}
    assert res["output_tokens_per_s"] > 0 and res["overlap_speedup"] > 0 and "device_busy_share" not in res
    assert "trace               not taken: RuntimeError" in out


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_phase_most_wanted_first(tmp_path):
    """scripts/gpu_check.py --dry-run on this CPU: every phase ok and in the JSON, the traced run
    first among the benchmarks and the kernel matrix last."""
    import os
    import subprocess

    out = tmp_path / "gpu_check.json"
    p = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "scripts" / "gpu_check.py"), "--dry-run",
                        "--out", str(out)], capture_output=True, text=True, timeout=900, check=False,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    phases = list(res["phases"])
    assert phases[:2] == ["model", "bench_pallas"] and phases[-1] == "kernels", phases
    assert all(v == "ok" for v in res["phases"].values()) and res["ok"]
    assert "trace" in res["bench"]["pallas"] and "device_lines_counted" in res["bench"]["pallas"]["trace"]
