"""`jaxsched run-batch`: an OpenAI batch file run offline through the server's own request path.

The command runs in-process (serving.cli.main) on one tiny engine built once for the module: its
create_engine is swapped for that engine, so the module pays one warm-up, not one per run.
"""

from __future__ import annotations

import json
import sys

import httpx
import openai
import pytest
from servers import uvicorn_thread

import jaxsched.engine.llm_engine
from jaxsched import LLM, SamplingParams
from serving import cli
from serving.app import build_app
from serving.async_engine import AsyncEngine

ENGINE = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 8}
PROMPTS = ["the capital of france is", "hello world , how are you", "one two three four", "what is a cat ?",
           "dogs and cats like to play", "language models predict the next token"]
# the acceptance file's 5 bad lines, at these 0-based positions
BAD = {17: "bad json", 53: "unknown url", 99: "stream", 142: "invalid parameter", 188: "missing body"}


def good_line(i: int) -> dict:
    """Line i of the acceptance file: completions on even lines, chat on odd ones, greedy, 1 to 6 tokens."""
    body = {"model": "tiny", "max_tokens": 1 + i % 6, "temperature": 0, "ignore_eos": True}
    if i % 2 == 0:
        return {"custom_id": f"req-{i:03d}", "method": "POST", "url": "/v1/completions",
                "body": {**body, "prompt": PROMPTS[i % len(PROMPTS)]}}
    return {"custom_id": f"req-{i:03d}", "method": "POST", "url": "/v1/chat/completions",
            "body": {**body, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}}


def acceptance_lines() -> list[str]:
    lines = []
    for i in range(200):
        line = good_line(i)
        match BAD.get(i):
            case "bad json":
                lines.append(json.dumps(line)[:40])  # cut short
                continue
            case "unknown url":
                line["url"] = "/v1/embeddings"
            case "stream":
                line["body"]["stream"] = True
            case "invalid parameter":
                line["body"]["temperature"] = -1
            case "missing body":
                del line["body"]
        lines.append(json.dumps(line))
    return lines


def reference_texts(llm: LLM) -> dict[int, str]:
    """The greedy text of every good line of the acceptance file, from the offline API."""
    good = [i for i in range(200) if i not in BAD]
    params = {i: SamplingParams(temperature=0, max_tokens=good_line(i)["body"]["max_tokens"], ignore_eos=True)
              for i in good}
    done = [i for i in good if i % 2 == 0]
    outs = llm.generate([good_line(i)["body"]["prompt"] for i in done], [params[i] for i in done], use_tqdm=False)
    chats = [i for i in good if i % 2 == 1]
    outs += llm.chat([good_line(i)["body"]["messages"] for i in chats], [params[i] for i in chats], use_tqdm=False)
    return {i: o.outputs[0].text for i, o in zip(done + chats, outs)}


@pytest.fixture(scope="module")
def llm(llama_dir):
    llm = LLM(llama_dir, **ENGINE)
    llm.refs = reference_texts(llm)  # offline, before run-batch takes the engine
    return llm


@pytest.fixture
def run(llm, monkeypatch, tmp_path):
    """run(lines, *flags) -> (exit code, output records, EngineArgs the command built, peak requests in
    the engine): `jaxsched run-batch` in this process on the module's engine."""
    eng = llm.llm_engine
    built = []
    peak = [0]
    stats = eng.stats

    def counting_stats():  # the AsyncEngine publishes these after every step
        s = stats()
        peak[0] = max(peak[0], s.num_requests_running + s.num_requests_waiting + s.num_requests_swapped)
        return s

    def create_engine(args):
        built.append(args)
        return eng

    monkeypatch.setattr(jaxsched.engine.llm_engine, "create_engine", create_engine)
    monkeypatch.setattr(eng, "stats", counting_stats)

    def go(lines: list[str], *flags: str) -> tuple[int, list[dict], object, int]:
        src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        src.write_text("\n".join(lines) + "\n")
        peak[0] = 0
        rc = cli.main(["--log-level", "WARNING", "run-batch", "-i", str(src), "-o", str(out), "some/model",
                       "--served-model-name", "tiny", "--max-model-len", "128", "--max-num-seqs", "8", *flags])
        records = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        return rc, records, built[-1] if built else None, peak[0]

    return go


def test_acceptance_file_200_lines_in_order_with_5_errors(run, llm, tmp_path):
    lines = acceptance_lines()
    err_path = tmp_path / "errors.jsonl"
    rc, out, args, peak = run(lines, "--error-file", str(err_path), "--max-in-flight", "4")
    assert rc == 0
    assert args.max_num_seqs == 8 and args.max_model_len == 128 and args.model == "some/model"  # engine flags
    assert len(out) == 200
    assert [r["custom_id"] for r in out] == [None if i == 17 else f"req-{i:03d}" for i in range(200)]
    failed = {i: r for i, r in enumerate(out) if r["error"] is not None}
    assert sorted(failed) == sorted(BAD)
    for r in failed.values():
        assert r["response"]["body"] is None and r["id"].startswith("batch_req_")
        assert set(r["error"]) == {"message", "type", "param", "code"}
    e = {kind: failed[i]["error"] for i, kind in BAD.items()}
    status = {kind: failed[i]["response"]["status_code"] for i, kind in BAD.items()}
    assert "line 18 is not valid JSON" in e["bad json"]["message"] and status["bad json"] == 400
    assert "/v1/embeddings" in e["unknown url"]["message"] and e["unknown url"]["param"] == "url"
    assert status["unknown url"] == 404
    assert "drop \"stream\"" in e["stream"]["message"] and e["stream"]["param"] == "stream"
    assert status["stream"] == 400
    assert "temperature" in e["invalid parameter"]["message"] and e["invalid parameter"]["param"] == "temperature"
    assert status["invalid parameter"] == 400 and e["invalid parameter"]["type"] == "invalid_request_error"
    assert "has no body" in e["missing body"]["message"] and e["missing body"]["param"] == "body"
    # every successful body is what OpenAI's client parses, with the server's usage and id
    for i, r in enumerate(out):
        if i in BAD:
            continue
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        if i % 2 == 0:
            parsed = openai.types.Completion.model_validate(body)
            text = parsed.choices[0].text
        else:
            parsed = openai.types.chat.ChatCompletion.model_validate(body)
            text = parsed.choices[0].message.content
        assert parsed.model == "tiny" and r["response"]["request_id"] == parsed.id
        assert parsed.usage.completion_tokens == 1 + i % 6 and parsed.choices[0].finish_reason == "length"
        assert text == llm.refs[i], i  # the offline API's greedy text for the same prompt
    # the error file: the failed lines, in input order, as in the output file
    assert [json.loads(x) for x in err_path.read_text().splitlines()] == [out[i] for i in sorted(BAD)]
    # at most --max-in-flight lines (one engine request each here) were ever in the engine
    assert peak == 4


def test_a_rejected_body_gets_the_http_servers_status_and_error(run, llm):
    bodies = [{"model": "tiny", "prompt": "hi", "temperature": -1},
              {"model": "tiny", "prompt": "hi", "max_tokens": "5"},
              {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
              {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]},
              {"model": "tiny", "prompt": "hi", "max_tokens": 1000}]
    urls = ["/v1/completions", "/v1/completions", "/v1/chat/completions", "/v1/chat/completions", "/v1/completions"]
    lines = [json.dumps({"custom_id": f"x{k}", "method": "POST", "url": u, "body": b})
             for k, (u, b) in enumerate(zip(urls, bodies))]
    rc, out, _, _ = run(lines)
    assert rc == 0
    engine = AsyncEngine(llm.llm_engine)
    try:
        with uvicorn_thread(build_app(engine, served_model_name="tiny")) as url:
            for rec, u, b in zip(out, urls, bodies):
                http = httpx.post(url + u, json=b, timeout=30)
                assert http.status_code >= 400
                assert rec["response"]["status_code"] == http.status_code
                assert rec["error"] == http.json()["error"]
    finally:
        engine.shutdown()


def test_envelope_faults_duplicates_and_several_prompts(run, monkeypatch, capsys):
    ok = {"model": "tiny", "prompt": "one two", "max_tokens": 2}
    lines = [
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": ok}),
        "",  # blank: skipped
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": ok}),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": ok}),
        json.dumps({"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": ok}),
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": ok}),
        json.dumps({"custom_id": "null-body", "method": "POST", "url": "/v1/completions", "body": None}),
        json.dumps({"custom_id": "list-body", "method": "POST", "url": "/v1/completions", "body": [1]}),
        json.dumps(["not", "an", "object"]),
        json.dumps({"custom_id": "two", "method": "POST", "url": "/v1/completions",
                    "body": {**ok, "prompt": ["one two", "three four"], "n": 2, "temperature": 1, "seed": 3}}),
    ]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the progress bar is drawn on a terminal only
    rc, out, _, _ = run(lines, "--max-in-flight", "1")
    assert rc == 0 and len(out) == 9
    assert [r["custom_id"] for r in out] == ["a", "a", None, None, "get", "null-body", "list-body", None, "two"]
    assert out[0]["error"] is None
    codes = [r["error"] and (r["response"]["status_code"], r["error"]["code"]) for r in out]
    assert codes[1:8] == [(400, "duplicate_custom_id"), (400, "missing_custom_id"), (400, "invalid_type"),
                          (405, "method_not_allowed"), (400, "missing_body"), (400, "invalid_json"),
                          (400, "invalid_json")]
    assert "already used by line 1" in out[1]["error"]["message"]
    assert "must be a JSON object" in out[6]["error"]["message"]  # the server's own words for a non-object body
    assert "line 9 must be a JSON object" in out[7]["error"]["message"]
    two = openai.types.Completion.model_validate(out[8]["response"]["body"])
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3] and two.usage.completion_tokens == 8
    bar = capsys.readouterr().err
    assert "run-batch" in bar and "9/9" in bar and "tok/s" in bar and "7 failed" in bar


def test_files_that_cannot_be_opened_fail_before_the_model_loads(tmp_path, monkeypatch, capsys):
    def no_engine(args):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(jaxsched.engine.llm_engine, "create_engine", no_engine)
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    missing = str(tmp_path / "nope.jsonl")
    assert cli.main(["run-batch", "-i", missing, "-o", str(tmp_path / "o.jsonl")]) == 1
    assert "cannot read the input file" in capsys.readouterr().err
    assert cli.main(["run-batch", "-i", str(src), "-o", str(tmp_path / "no-dir" / "o.jsonl")]) == 1
    assert "cannot write the output file" in capsys.readouterr().err
    assert cli.main(["run-batch", "--input-file", str(src), "--output-file", str(src)]) == 1
    assert "is the input file" in capsys.readouterr().err and src.read_text() == "{}\n"
    assert cli.main(["run-batch", "-i", str(src), "-o", str(tmp_path / "o.jsonl"), "--max-in-flight", "0"]) == 2
    assert "--max-in-flight must be >= 1" in capsys.readouterr().err


def test_lines_held_stay_within_max_in_flight_behind_a_slow_head():
    """A line holds its slot until it is written: behind a slow first line, the lines read but not
    yet written (in the engine, or finished and waiting for it) never exceed --max-in-flight, so a
    long file does not pile up in memory. A refused first id leaves the id to a later valid line,
    and a reply that cannot be decoded fails its line alone."""
    import asyncio
    import io

    from serving.run_batch import BatchRunner

    out = io.BytesIO()
    started = 0
    peak = 0
    ok = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m", "choices": [],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()

    async def app(scope, receive, send):
        nonlocal started, peak
        body = (await receive())["body"]
        started += 1
        peak = max(peak, started - out.getvalue().count(b"\n"))
        if b"slow" in body:
            await asyncio.sleep(0.3)
        reply = b"not json" if b"garbled" in body else ok
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": reply})

    def line(cid, prompt, **extra):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                           "body": {"model": "m", "prompt": prompt}, **extra}).encode()

    lines = [line("c0", "slow"), line("dup", "x", url="/v1/nope"), line("dup", "x"), line("g", "garbled")]
    lines += [line(f"c{i}", "fast") for i in range(1, 40)]
    summary = asyncio.run(BatchRunner(app, max_in_flight=3).run(lines, out))
    rows = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [r["custom_id"] for r in rows] == ["c0", "dup", "dup", "g"] + [f"c{i}" for i in range(1, 40)]
    assert peak <= 3, peak
    assert rows[1]["error"]["code"] == "not_found" and rows[2]["error"] is None  # the id went to the valid line
    assert rows[3]["error"]["type"] == "server_error" and rows[3]["response"]["body"] is None
    assert summary.failed == 2 and all(r["error"] is None for r in rows[4:])


def test_a_failed_start_leaves_an_existing_output_byte_for_byte(tmp_path, monkeypatch):
    """The output is written to a temporary file beside it and renamed at the end: a model that
    fails to load leaves yesterday's results as they were, and no temporary file behind."""
    def broken(args):
        raise FileNotFoundError("no model at some/model")

    monkeypatch.setattr(jaxsched.engine.llm_engine, "create_engine", broken)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps(good_line(0)) + "\n")
    out.write_bytes(b'{"custom_id": "yesterday"}\n\x00 binary tail')
    before = out.read_bytes()
    for flags in ([], ["--resume"]):
        with pytest.raises(FileNotFoundError):
            cli.main(["run-batch", "-i", str(src), "-o", str(out), "some/model", *flags])
        assert out.read_bytes() == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_an_over_long_line_is_an_error_line_and_the_rest_run(run):
    lines = [json.dumps(good_line(0)), json.dumps({**good_line(1), "pad": "x" * 5000}), json.dumps(good_line(2))]
    rc, records, _, _ = run(lines, "--max-line-bytes", "4096")
    assert rc == 0 and [r["custom_id"] for r in records] == ["req-000", None, "req-002"]
    assert records[1]["error"]["code"] == "line_too_long" and "line 2" in records[1]["error"]["message"]
    assert records[0]["error"] is None and records[2]["error"] is None


def test_resume_skips_complete_lines_and_redoes_a_torn_one(run, tmp_path):
    lines = [json.dumps(good_line(i)) for i in range(12)]
    rc, full, _, _ = run(lines)
    assert rc == 0 and len(full) == 12
    out = tmp_path / "out.jsonl"
    kept = out.read_text().splitlines(keepends=True)[:5]
    out.write_text("".join(kept) + kept[5 - 1][:30])  # five whole lines and a torn sixth
    rc, records, _, _ = run(lines, "--resume")
    assert rc == 0
    ids = [r["custom_id"] for r in records]
    assert sorted(ids) == sorted(f"req-{i:03d}" for i in range(12)) and len(set(ids)) == 12
    assert records[:5] == full[:5]  # the complete lines are kept as they were
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in records}
    assert all(texts[r["custom_id"]] == r["response"]["body"]["choices"][0] for r in full)


@pytest.mark.slow  # ~38 s: three run-batch processes, one killed mid-file
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGKILL")
def test_killed_with_sigkill_then_resumed_or_rerun_has_every_custom_id_once(llama_dir, tmp_path, run):
    """A run killed at a random point: rerun without --resume, the output holds what it held before
    (nothing: the run had not ended); resumed, every custom_id is there exactly once."""
    import os
    import random
    import signal
    import subprocess
    import time
    from pathlib import Path

    lines = [json.dumps(good_line(i)) for i in range(60)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for resume in (False, True):
        out = tmp_path / f"killed-{resume}.jsonl"
        cmd = [sys.executable, "-m", "serving.cli", "--log-level", "WARNING", "run-batch", "-i", str(src), "-o",
               str(out), llama_dir, "--served-model-name", "tiny", "--max-model-len", "128", "--max-num-seqs", "2",
               "--max-in-flight", "2", "--block-size", "8", *(["--resume"] if resume else [])]
        proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        partial = list(tmp_path.glob(f".{out.name}.*.partial"))
        deadline = time.monotonic() + 300
        want = random.Random(resume).randint(3, 40)  # results written before the kill
        while time.monotonic() < deadline and proc.poll() is None:
            target = out if resume else next(iter(partial), None)
            if target is not None and target.exists() and target.read_bytes().count(b"\n") >= want:
                break
            partial = partial or list(tmp_path.glob(f".{out.name}.*.partial"))
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if not resume:
            assert not out.exists()  # the run did not end: no output in its place
            continue
        assert out.read_bytes().count(b"\n") >= want
        rc = cli.main(["--log-level", "WARNING", "run-batch", "-i", str(src), "-o", str(out), "some/model",
                       "--served-model-name", "tiny", "--max-model-len", "128", "--resume"])
        ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]  # (run's engine: the fixture's)
        assert rc == 0 and sorted(ids) == sorted(f"req-{i:03d}" for i in range(60)), ids


def test_prompt_logprobs_in_a_batch_file(run, llm):
    """A line asking for prompt_logprobs gets them in its response body, as the HTTP route gives them
    (per choice on completions, at the top on chat), beside the offline engine's figures."""
    want = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                        use_tqdm=False)[0]
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    lines = [json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                         "body": {**body, "prompt": PROMPTS[0]}}),
             json.dumps({"custom_id": "h", "method": "POST", "url": "/v1/chat/completions",
                         "body": {**body, "messages": [{"role": "user", "content": PROMPTS[0]}]}})]
    rc, out, _, _ = run(lines)
    assert rc == 0
    comp = out[0]["response"]["body"]["choices"][0]["prompt_logprobs"]
    assert comp[0] is None and len(comp) == len(want.prompt_token_ids)
    for t, entry in enumerate(want.prompt_logprobs[1:], 1):
        tok = want.prompt_token_ids[t]
        assert abs(comp[t][str(tok)]["logprob"] - entry[tok].logprob) < 1e-5
    chat = out[1]["response"]["body"]["prompt_logprobs"]
    assert chat[0] is None and len(chat) == out[1]["response"]["body"]["usage"]["prompt_tokens"]
