"""Structured outputs, tool calling and the honoured-or-refused request fields, end to end through the
official `openai` client against a server on a tiny random model: every constrained output parses and
validates (greedy and sampled, sent concurrently so they run as batches), forced tool calls come back
as OpenAI tool calls (streamed or not, the same), bad definitions are 400s naming the field, nothing
is silently ignored, and a mixed burst of constrained and plain requests compiles nothing.

The model writes JSON with the default whitespace (up to 16 characters between two tokens, all of
which a greedy random model uses), and the tool listing in the prompt takes hundreds of tokens of the
tiny byte-level tokenizer: the checkpoint here has a 2,048-token context and requests leave room."""

from __future__ import annotations

import json
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import tiny
from compiles import no_compilation
from servers import uvicorn_thread

from jaxsched import LLM
from serving.app import build_app
from serving.async_engine import AsyncEngine

# Small limits, so that warm-up compiles few (T, S) pairs: T in {16, 32, 64}, S = 8. The step-cost
# model is off (it sizes steps from measured times).
ENGINE = {"max_model_len": 2048, "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 16,
          "step_cost_model": False}
KEY = "structured-key"
MAX_TOKENS = 1500  # room for the largest schema below with the default whitespace
TOOL_MAX_TOKENS = 1000  # the prompt lists the tools: about 400 tokens for one, 700 for two
ASK = [{"role": "user", "content": "what is a cat ? answer in json ."}]
# json_object bounds no string: on most prompts a greedy random model writes a key forever; on this one
# it closes the object (greedy, and sampled with seed 2), on both routes
JSON_PROMPT = "the capital of france is"
JSON_ASK = [{"role": "user", "content": JSON_PROMPT}]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": WEATHER_SCHEMA}}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]},
                                                "exact": {"type": "boolean"}},
               "required": ["zone", "exact"], "additionalProperties": False}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "the time in a zone",
                                          "parameters": TIME_SCHEMA}}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
ASK_WEATHER = [{"role": "user", "content": "what is the weather in paris ?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class Server:
    def __init__(self, url: str, engine: AsyncEngine) -> None:
        self.url, self.engine = url, engine
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        self.http = httpx.Client(base_url=url, timeout=60)

    def token_text(self, token_id: int) -> str:
        r = self.http.post("/detokenize", json={"tokens": [token_id]})
        assert r.status_code == 200, r.text
        return r.json()["prompt"]

    def token_ids(self, text: str) -> list[int]:
        r = self.http.post("/tokenize", json={"prompt": text})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer_dir):
    folder = tiny.build_model(str(tmp_path_factory.mktemp("m")), "llama", tokenizer_dir,
                              max_position_embeddings=2048)
    with open(f"{folder}/config.json") as f:
        assert json.load(f)["max_position_embeddings"] == 2048
    engine = AsyncEngine(LLM(folder, **ENGINE).llm_engine)
    try:
        with uvicorn_thread(build_app(engine, served_model_name="tiny", api_key=KEY)) as url:
            yield Server(url, engine)
    finally:
        engine.shutdown()


def concurrently(fn, jobs, workers: int = 12) -> list:
    """fn(job) for each job on a thread pool (the server batches them), results in order."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, jobs))


def create(server, route: str, **kw):
    """One request to /v1/chat/completions (route "chat", ASK by default) or /v1/completions."""
    if route == "chat":
        return server.client.chat.completions.create(model="tiny", messages=kw.pop("messages", ASK), **kw)
    return server.client.completions.create(model="tiny", prompt=kw.pop("prompt", "hi"), **kw)


def bad_request(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    return info.value


def error(e: openai.APIStatusError) -> dict:
    """The {"message", "type", "param", "code"} of an error response."""
    body = e.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"], body
    return body


# -- 1. random JSON Schemas --------------------------------------------------------------------------
KEYS = ["name", "age", "color", "ok", "tags", "size", "id", "info", "score", "city", "items", "flag"]
WORDS = ["red", "green", "blue", "cat", "dog", "sun", "yes", "no", "S", "M", "XL", "paris"]


def random_scalar(rng: random.Random) -> tuple[dict, str]:
    kind = rng.choice(["enum", "integer", "boolean", "string"])
    if kind == "enum":
        schema = {"enum": rng.sample(WORDS, rng.randint(2, 4))}
        if rng.random() < 0.5:
            schema["type"] = "string"
        return schema, kind
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 300)}, kind
    if kind == "boolean":
        return {"type": "boolean"}, kind
    schema = {"type": "string", "maxLength": rng.randint(1, 6)}
    if rng.random() < 0.3:
        schema["minLength"] = rng.randint(0, schema["maxLength"])
    return schema, kind


def random_value(rng: random.Random, depth: int, kinds: set[str]) -> dict:
    roll = rng.random()
    if roll < 0.2 and depth == 0:
        kinds.add("object")
        return random_object(rng, depth + 1, kinds)
    if roll < 0.4:
        kinds.add("array")
        items, kind = random_scalar(rng)
        kinds.add(kind)
        schema = {"type": "array", "items": items, "maxItems": rng.randint(1, 3)}
        if rng.random() < 0.5:
            schema["minItems"] = rng.randint(0, schema["maxItems"])
        return schema
    schema, kind = random_scalar(rng)
    kinds.add(kind)
    return schema


def random_object(rng: random.Random, depth: int, kinds: set[str]) -> dict:
    names = rng.sample(KEYS, rng.randint(1, 3 if depth == 0 else 2))
    required = names if rng.random() < 0.7 else rng.sample(names, rng.randint(1, len(names)))
    if len(required) < len(names):
        kinds.add("optional")
    return {"type": "object", "properties": {n: random_value(rng, depth, kinds) for n in names},
            "required": required, "additionalProperties": False}


def random_schemas(seed: int = 2024, count: int = 20) -> tuple[list[dict], set[str]]:
    rng = random.Random(seed)
    kinds: set[str] = set()
    return [random_object(rng, 0, kinds) for _ in range(count)], kinds


def test_random_schemas_cover_every_feature():
    schemas, kinds = random_schemas()
    assert len(schemas) == 20
    assert kinds == {"object", "array", "enum", "integer", "boolean", "string", "optional"}
    for s in schemas:
        jsonschema.Draft202012Validator.check_schema(s)


def json_schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_random_json_schemas_greedy_and_sampled(server):
    schemas, _ = random_schemas()

    def run(job):
        i, temperature = job
        r = server.client.chat.completions.create(
            model="tiny", messages=ASK, response_format=json_schema_format(schemas[i], f"schema_{i}"),
            temperature=temperature, seed=100 + i, max_tokens=MAX_TOKENS)
        return r.choices[0]

    jobs = [(i, t) for t in (0.0, 1.0) for i in range(len(schemas))]
    for (i, temperature), choice in zip(jobs, concurrently(run, jobs)):
        what = f"schema {i} at temperature {temperature}: {choice.message.content!r}"
        assert choice.finish_reason == "stop", what
        jsonschema.validate(json.loads(choice.message.content), schemas[i])
        assert choice.message.tool_calls is None, what


def test_seeded_constrained_sampling_is_reproducible_in_any_batch(server):
    schema = random_schemas()[0][3]

    def run(seed):
        r = server.client.chat.completions.create(model="tiny", messages=ASK, response_format=json_schema_format(schema),
                                                  temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)
        return r.choices[0].message.content

    texts = concurrently(run, [1, 2, 1, 2, 1, 2])
    assert texts[0] == texts[2] == texts[4] and texts[1] == texts[3] == texts[5]
    assert texts[0] != texts[1]
    assert run(1) == texts[0]  # alone in its batch too


# -- 2. json_object, regex, choice on both routes ----------------------------------------------------
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICE = ["red", "green", "blue sky", 'say "hi"']


def chat_text(server, **kw) -> tuple[str, str]:
    messages = JSON_ASK if "response_format" in kw else ASK
    r = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=kw.pop("max_tokens", 400),
                                              **kw)
    return r.choices[0].message.content, r.choices[0].finish_reason


def completion_text(server, **kw) -> tuple[str, str]:
    r = server.client.completions.create(model="tiny", prompt=JSON_PROMPT, max_tokens=kw.pop("max_tokens", 400), **kw)
    return r.choices[0].text, r.choices[0].finish_reason


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_json_object_regex_and_choice(server, route):
    text_of = chat_text if route == "chat" else completion_text

    def rf(body):  # response_format is a parameter of chat only in the client; vLLM takes it on both
        return {"response_format": body} if route == "chat" else {"extra_body": {"response_format": body}}

    jobs = [
        ("json_object", {**rf({"type": "json_object"}), "temperature": 0}),
        ("json_object", {**rf({"type": "json_object"}), "temperature": 1.0, "seed": 2}),
        ("regex", {"extra_body": {"structured_outputs": {"regex": REGEX}}, "temperature": 0}),
        ("regex", {"extra_body": {"structured_outputs": {"regex": REGEX}}, "temperature": 1.0, "seed": 3}),
        ("regex", {"extra_body": {"guided_regex": REGEX}, "temperature": 1.0, "seed": 4}),
        ("choice", {"extra_body": {"structured_outputs": {"choice": CHOICE}}, "temperature": 0}),
        ("choice", {"extra_body": {"structured_outputs": {"choice": CHOICE}}, "temperature": 1.0, "seed": 5}),
        ("choice", {"extra_body": {"guided_choice": CHOICE}, "temperature": 1.0, "seed": 6}),
    ]
    results = concurrently(lambda job: text_of(server, **job[1]), jobs)
    for (kind, kw), (text, finish) in zip(jobs, results):
        assert finish == "stop", (kind, kw, text)
        if kind == "json_object":
            assert isinstance(json.loads(text), dict), text
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICE, text


def test_n_samples_follow_their_own_grammar(server):
    r = server.client.completions.create(model="tiny", prompt="hello world", n=4, temperature=1.0, seed=11,
                                         max_tokens=200, extra_body={"structured_outputs": {"regex": REGEX}})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for c in r.choices:
        assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), c.text
    assert len({c.text for c in r.choices}) > 1


def test_streamed_json_schema_matches_the_whole_response(server):
    schema = random_schemas()[0][5]
    kw = {"model": "tiny", "messages": ASK, "response_format": json_schema_format(schema), "temperature": 0,
          "max_tokens": MAX_TOKENS}
    whole = server.client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(server.client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(whole), schema)


# -- 3. bad definitions ------------------------------------------------------------------------------
BAD_DEFINITIONS = [  # (what, chat request fields, the param named)
    ("invalid regex", {"extra_body": {"structured_outputs": {"regex": "(a"}}}, "structured_outputs.regex"),
    ("a schema that is no schema", {"extra_body": {"structured_outputs": {"json": {"type": 5}}}},
     "structured_outputs.json"),
    ("invalid grammar", {"extra_body": {"structured_outputs": {"grammar": "start: (("}}},
     "structured_outputs.grammar"),
    ("empty choice", {"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
    ("two kinds in structured_outputs", {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
     "structured_outputs"),
    ("json_schema without schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("unknown response_format type", {"response_format": {"type": "yaml"}}, "response_format.type"),
]


@pytest.mark.parametrize("what,fields,param", BAD_DEFINITIONS, ids=[b[0] for b in BAD_DEFINITIONS])
def test_bad_definitions_are_400_naming_the_field(server, what, fields, param):
    e = bad_request(lambda: server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, **fields))
    assert error(e)["param"] == param, error(e)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_two_constraints_at_once_are_a_400(server, route):
    both = {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}
    body = error(bad_request(lambda: create(server, route, max_tokens=5, extra_body=both)))
    assert body["param"] in ("response_format", "structured_outputs"), body
    assert "response_format" in body["message"] and "structured_outputs" in body["message"]
    body = error(bad_request(lambda: server.client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=5, tools=[WEATHER], tool_choice="required",
        response_format={"type": "json_object"})))
    assert body["param"] in ("response_format", "tool_choice"), body


# a definition that fails to compile names the field the client sent it in
def test_a_bad_schema_in_response_format_names_response_format(server):
    e = bad_request(lambda: server.client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=5, response_format=json_schema_format({"type": 5})))
    assert error(e)["param"].startswith("response_format"), error(e)


def test_a_bad_guided_regex_names_guided_regex(server):
    e = bad_request(lambda: server.client.completions.create(model="tiny", prompt="hi", max_tokens=5,
                                                             extra_body={"guided_regex": "(a"}))
    assert error(e)["param"] == "guided_regex", error(e)


def test_a_forced_tool_with_a_bad_parameters_schema_names_tools(server):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    e = bad_request(lambda: server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5,
                                                                  tools=[bad], tool_choice="required"))
    assert error(e)["param"] == "tools", error(e)


def test_server_serves_after_bad_definitions(server):
    text, finish = chat_text(server, temperature=0, extra_body={"structured_outputs": {"regex": REGEX}})
    assert finish == "stop" and re.fullmatch(REGEX, text)


# -- 4. tools ----------------------------------------------------------------------------------------
def check_calls(choice, tools_by_name: dict, one: bool = False) -> list:
    what = repr(choice)
    assert choice.finish_reason == "tool_calls", what
    calls = choice.message.tool_calls
    assert calls, what
    if one:
        assert len(calls) == 1, what
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function", what
        assert call.function.name in tools_by_name, what
        jsonschema.validate(json.loads(call.function.arguments), tools_by_name[call.function.name])
    assert len({c.id for c in calls}) == len(calls)
    return calls


def test_forced_tool_calls_always_parse_and_validate(server):
    jobs = [("named", 0.0, None, None), ("required", 0.0, None, False)]
    jobs += [("named", 1.0, seed, None) for seed in range(4)]
    jobs += [("required", 1.0, seed, False) for seed in range(4)]
    jobs += [("required", 1.0, seed, None) for seed in range(4)]  # parallel calls allowed

    def run(job):
        mode, temperature, seed, parallel = job
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = server.client.chat.completions.create(
            model="tiny", messages=ASK_WEATHER, tools=[WEATHER], tool_choice=NAMED if mode == "named" else "required",
            temperature=temperature, seed=seed, max_tokens=TOOL_MAX_TOKENS, **extra)
        return r.choices[0]

    for (mode, _, _, parallel), choice in zip(jobs, concurrently(run, jobs)):
        assert choice.message.content is None, choice
        check_calls(choice, SCHEMAS, one=mode == "named" or parallel is False)


def test_required_without_parallel_calls_gives_exactly_one_call_of_either_tool(server):
    def run(seed):
        r = server.client.chat.completions.create(
            model="tiny", messages=ASK_WEATHER, tools=[WEATHER, CLOCK], tool_choice="required",
            parallel_tool_calls=False, temperature=0 if seed is None else 1.0, seed=seed, max_tokens=TOOL_MAX_TOKENS)
        return r.choices[0]

    names = set()
    for choice in concurrently(run, [None, *range(8)]):
        names.add(check_calls(choice, SCHEMAS, one=True)[0].function.name)
    assert names == {"get_weather", "get_time"}  # both tools are reachable


def test_n_2_forced_calls(server):
    r = server.client.chat.completions.create(model="tiny", messages=ASK_WEATHER, tools=[WEATHER], tool_choice=NAMED,
                                              n=2, temperature=1.0, seed=9, max_tokens=TOOL_MAX_TOKENS)
    assert sorted(c.index for c in r.choices) == [0, 1]
    ids = [check_calls(c, SCHEMAS, one=True)[0].id for c in r.choices]
    assert ids[0] != ids[1]


def streamed_calls(server, **kw) -> tuple[list[dict], str | None, str]:
    """The calls of a streamed chat response, put together from delta.tool_calls by index."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in server.client.chat.completions.create(model="tiny", stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                if d.index not in calls:  # the first delta of a call has its id, type and name
                    assert d.id and d.id.startswith("call_") and d.type == "function" and d.function.name, d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and not d.function.name, d
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("tool_choice", ["named", "required"])
def test_streamed_calls_equal_the_whole_response(server, tool_choice):
    kw = {"messages": ASK_WEATHER, "tools": [WEATHER, CLOCK], "temperature": 0, "max_tokens": TOOL_MAX_TOKENS,
          "tool_choice": NAMED if tool_choice == "named" else "required", "parallel_tool_calls": False}
    whole = check_calls(server.client.chat.completions.create(model="tiny", **kw).choices[0], SCHEMAS, one=True)
    calls, finish, content = streamed_calls(server, **kw)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(whole[0].function.name, whole[0].function.arguments)]


def test_streamed_parallel_calls_equal_the_whole_response(server):
    kw = {"messages": ASK_WEATHER, "tools": [WEATHER, CLOCK], "tool_choice": "required", "temperature": 1.0,
          "seed": 4, "max_tokens": TOOL_MAX_TOKENS}
    whole = check_calls(server.client.chat.completions.create(model="tiny", **kw).choices[0], SCHEMAS)
    calls, finish, _ = streamed_calls(server, **kw)
    assert finish == "tool_calls" and len(whole) > 1  # seed 4 makes several calls (sampler.row_uniform)
    assert [(c["name"], c["arguments"]) for c in calls] == [(w.function.name, w.function.arguments) for w in whole]


def test_tool_round_trip(server):
    first = server.client.chat.completions.create(model="tiny", messages=ASK_WEATHER, tools=[WEATHER],
                                                  tool_choice=NAMED, temperature=0, max_tokens=TOOL_MAX_TOKENS)
    call = check_calls(first.choices[0], SCHEMAS, one=True)[0]

    def answer(result: str):
        messages = [*ASK_WEATHER,
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                    {"role": "tool", "tool_call_id": call.id, "content": result}]
        return server.client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                                     temperature=0, max_tokens=16)

    short, long = answer("sunny"), answer("sunny , twenty degrees , no wind at all today")
    for r in (short, long):
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call (as the text a hermes model writes: this template takes no tools) and its result are in the prompt
    rendered = json.dumps({"name": call.function.name, "arguments": json.loads(call.function.arguments)})
    added = short.usage.prompt_tokens - first.usage.prompt_tokens
    assert added >= len(server.token_ids(rendered)) + len(server.token_ids("sunny")), added
    assert long.usage.prompt_tokens > short.usage.prompt_tokens


def test_auto_tool_choice_on_a_random_model_answers(server):
    def run(job):
        temperature, seed, stream = job
        kw = {"model": "tiny", "messages": ASK_WEATHER, "tools": [WEATHER, CLOCK], "tool_choice": "auto",
              "temperature": temperature, "seed": seed, "max_tokens": 64}
        if stream:
            return streamed_calls(server, **{k: v for k, v in kw.items() if k != "model"})
        return server.client.chat.completions.create(**kw).choices[0]

    jobs = [(0.0, None, False), (0.0, None, True), *((1.0, s, False) for s in range(3))]
    for (_, _, stream), out in zip(jobs, concurrently(run, jobs)):
        if stream:
            calls, finish, content = out
            assert finish in ("stop", "length", "tool_calls") and (calls or content)
        else:
            assert out.finish_reason in ("stop", "length", "tool_calls")
            assert out.message.content or out.message.tool_calls


# Text in the hermes format, forced by a regex, so that tool_choice "auto" has calls to read: some
# content, a call, and sometimes a second call
HERMES = (r'(ok )?<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}"\}\}\n</tool_call>'
          r'(\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(utc|cet)", "exact": (true|false)\}\}'
          r'\n</tool_call>)?')


def test_auto_reads_hermes_calls_streamed_or_not(server):
    def run(job):
        seed, stream = job
        kw = {"messages": ASK_WEATHER, "tools": [WEATHER, CLOCK], "temperature": 1.0, "seed": seed,
              "max_tokens": 300, "extra_body": {"structured_outputs": {"regex": HERMES}}}
        if stream:
            return streamed_calls(server, **kw)
        return server.client.chat.completions.create(model="tiny", **kw).choices[0]

    jobs = [(seed, stream) for seed in range(6) for stream in (False, True)]
    results = concurrently(run, jobs)
    counts, contents = set(), set()
    for i in range(0, len(jobs), 2):
        whole, (calls, finish, content) = results[i], results[i + 1]
        got = check_calls(whole, SCHEMAS)
        counts.add(len(got))
        contents.add(whole.message.content)
        assert whole.message.content in (None, "ok")
        assert finish == "tool_calls" and content == (whole.message.content or "")
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in got]
    assert counts == {1, 2} and contents == {None, "ok"}  # the seeds cover each shape


INVALID_TOOLS = [  # (what, request fields, the param named)
    ("bad function name", {"tools": [{"type": "function", "function": {"name": "get weather!"}}]}, "tools"),
    ("two tools of one name", {"tools": [WEATHER, WEATHER]}, "tools"),
    ("a tool that is not a function", {"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}, "tools"),
    ("parameters not an object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools"),
    ("tool_choice naming an unknown function",
     {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ("tool_choice required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("tool_choice of no known kind", {"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
]


@pytest.mark.parametrize("what,fields,param", INVALID_TOOLS, ids=[t[0] for t in INVALID_TOOLS])
def test_invalid_tools_are_400_naming_the_field(server, what, fields, param):
    e = bad_request(lambda: server.client.chat.completions.create(model="tiny", messages=ASK_WEATHER, max_tokens=5,
                                                                  **fields))
    assert error(e)["param"] == param, error(e)


def test_tool_choice_none_leaves_the_tools_out(server):
    plain = server.client.chat.completions.create(model="tiny", messages=ASK_WEATHER, temperature=0, max_tokens=8)
    none = server.client.chat.completions.create(model="tiny", messages=ASK_WEATHER, tools=[WEATHER],
                                                 tool_choice="none", temperature=0, max_tokens=8)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None


# -- 5. nothing silently ignored ---------------------------------------------------------------------
REFUSED = [("use_beam_search", True), ("bad_words", ["cat"]), ("length_penalty", 0.5),
           ("logits_processors", ["my.module:Processor"])]


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("field,value", REFUSED, ids=[f for f, _ in REFUSED])
def test_refused_fields_are_400_naming_them(server, route, field, value):
    body = error(bad_request(lambda: create(server, route, max_tokens=4, extra_body={field: value})))
    assert body["param"] == field and body["code"] == "unsupported_parameter", body


def test_refused_fields_at_their_defaults_are_taken(server):
    r = server.client.completions.create(model="tiny", prompt="hi", max_tokens=4,
                                         extra_body={"use_beam_search": False, "length_penalty": 1.0,
                                                     "bad_words": [], "priority": 0})
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_priority_is_refused_under_fcfs(server, route):
    priority = {"chat": 1, "completions": -3}[route]
    body = error(bad_request(lambda: create(server, route, max_tokens=4, extra_body={"priority": priority})))
    assert body["param"] == "priority" and body["code"] == "unsupported_parameter", body


def single_token(server, text: str) -> int:
    ids = server.token_ids(text)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_logit_bias_forces_a_token(server):
    cat = single_token(server, " cat")
    piece = server.token_text(cat)
    r = server.client.completions.create(model="tiny", prompt="the capital of france is", temperature=0, max_tokens=8,
                                         logprobs=1, logit_bias={str(cat): 100}, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.logprobs.tokens == [piece] * 8 and c.text == piece * 8
    assert server.token_ids(c.text) == [cat] * 8
    chat = server.client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=6,
                                                 logit_bias={str(cat): 100}, logprobs=True,
                                                 extra_body={"ignore_eos": True})
    assert [e.token for e in chat.choices[0].logprobs.content] == [piece] * 6
    # a bias of -100 takes a token away: of two allowed tokens, the other one is always chosen
    brace = single_token(server, "{")
    for banned, kept in ((cat, brace), (brace, cat)):
        r = server.client.completions.create(model="tiny", prompt="the capital of france is", temperature=0,
                                             max_tokens=6, logit_bias={str(banned): -100},
                                             extra_body={"allowed_token_ids": [cat, brace]})
        assert r.choices[0].text == server.token_text(kept) * 6


@pytest.mark.parametrize("bias", [{"cat": 5}, {"1.5": 5}, {"99999": 5}, {"-1": 5}, {"5": 1000}],
                         ids=["word", "float", "out of vocab", "negative", "too large"])
def test_bad_logit_bias_is_a_400(server, bias):
    e = bad_request(lambda: server.client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                                             logit_bias=bias))
    assert error(e)["param"] == "logit_bias", error(e)


def test_allowed_token_ids_restrict_the_output(server):
    allowed = [single_token(server, " cat"), single_token(server, "{"), single_token(server, "}")]
    pieces = {server.token_text(t) for t in allowed}
    r = server.client.completions.create(model="tiny", prompt="hello world", temperature=1.0, seed=7, max_tokens=24,
                                         logprobs=1, extra_body={"allowed_token_ids": allowed})
    c = r.choices[0]
    assert set(c.logprobs.tokens) <= pieces and len(set(c.logprobs.tokens)) > 1, c.logprobs.tokens
    # EOS is not allowed: the output runs to max_tokens
    assert c.finish_reason == "length" and r.usage.completion_tokens == 24
    assert set(server.token_ids(c.text)) <= set(allowed)
    chat = server.client.chat.completions.create(model="tiny", messages=ASK, temperature=1.0, seed=8, max_tokens=12,
                                                 logprobs=True, extra_body={"allowed_token_ids": allowed})
    assert {e.token for e in chat.choices[0].logprobs.content} <= pieces


def test_allowed_token_ids_with_a_grammar_is_a_400(server):
    e = bad_request(lambda: server.client.completions.create(
        model="tiny", prompt="hi", max_tokens=4,
        extra_body={"allowed_token_ids": [single_token(server, " cat")], "structured_outputs": {"regex": "a+"}}))
    assert error(e)["param"] == "allowed_token_ids", error(e)


def test_truncate_prompt_tokens(server):
    long = "one two three four five six seven eight nine ten"
    assert len(server.token_ids(long)) > 3
    r = server.client.completions.create(model="tiny", prompt=long, max_tokens=2,
                                         extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    c = server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2,
                                              extra_body={"truncate_prompt_tokens": 3})
    assert c.usage.prompt_tokens == 3
    e = bad_request(lambda: server.client.completions.create(model="tiny", prompt=long, max_tokens=2,
                                                             extra_body={"truncate_prompt_tokens": 0}))
    assert error(e)["param"] == "truncate_prompt_tokens"


# -- 6. no compilation after warm-up -----------------------------------------------------------------
def test_mixed_burst_compiles_nothing(server):
    schemas, _ = random_schemas()
    cat = single_token(server, " cat")
    plain = {"temperature": 1.0, "max_tokens": 24}
    jobs = [
        ("chat", {"response_format": json_schema_format(schemas[7]), "temperature": 0, "max_tokens": MAX_TOKENS}),
        ("chat", {"response_format": json_schema_format(schemas[8]), "temperature": 1.0, "seed": 1,
                  "max_tokens": MAX_TOKENS}),
        ("chat", {"messages": JSON_ASK, "response_format": {"type": "json_object"}, "temperature": 0,
                  "max_tokens": 400}),
        ("cmpl", {"extra_body": {"structured_outputs": {"regex": REGEX}}, "temperature": 1.0, "seed": 2, "n": 2,
                  "max_tokens": 100}),
        ("cmpl", {"extra_body": {"guided_choice": CHOICE}, "temperature": 0, "max_tokens": 20}),
        ("tools", {"tool_choice": NAMED, "temperature": 1.0, "seed": 3}),
        ("tools", {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 0, "stream": True}),
        ("cmpl", {"logit_bias": {str(cat): 100}, "temperature": 0, "max_tokens": 16, "logprobs": 2}),
        ("cmpl", {"logit_bias": {str(cat): -100, "93": 20}, **plain, "seed": 4}),
        ("cmpl", {"extra_body": {"allowed_token_ids": [cat, 93, 95]}, **plain, "seed": 5}),
        ("cmpl", {**plain, "seed": 6, "stream": True}),
        ("chat", {**plain, "seed": 7, "logprobs": True, "top_logprobs": 3}),
        ("chat", {"temperature": 0, "max_tokens": 40, "presence_penalty": 0.5}),
    ]

    def run(job):
        route, kw = job
        if route == "tools":
            create = server.client.chat.completions.create
            out = create(model="tiny", messages=ASK_WEATHER, tools=[WEATHER], max_tokens=TOOL_MAX_TOKENS, **kw)
        elif route == "chat":
            out = server.client.chat.completions.create(model="tiny", **{"messages": ASK, **kw})
        else:
            out = server.client.completions.create(model="tiny", prompt="the capital of france is", **kw)
        if kw.get("stream"):
            out = list(out)
            assert out and all(c.choices is not None for c in out)
        return out

    # every definition compiled before the burst: grammar compiles are not jax's, but keep the burst
    # about the engine's steps
    with no_compilation():
        outs = concurrently(run, jobs * 2, workers=16)
    assert len(outs) == 2 * len(jobs)
    assert all(o.choices[0].finish_reason == "stop" for o in (outs[0], outs[1], outs[2]))


def test_a_grammar_that_compiles_too_long_is_a_400_and_the_server_goes_on(server):
    """A second app on the same engine, whose grammars may take 50 ms: a compile that takes longer
    (held up here, as a hostile schema would be) is a 400 naming the field, and nothing reaches the
    engine; the first server, with the default limit, keeps serving."""
    slow_app = build_app(server.engine, served_model_name="tiny", api_key=KEY, grammar_timeout=0.05)
    grammars = slow_app.state.server.grammars
    compile_ = grammars.compile
    slow_app.state.server.grammars = type("Slow", (), {
        "compile": staticmethod(lambda so: (time.sleep(0.5), compile_(so))[1]),
        "ll_tokenizer": grammars.ll_tokenizer})()
    with uvicorn_thread(slow_app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        e = bad_request(lambda: client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=5, extra_body={"guided_regex": "[0-9]{3}"}))
        body = error(e)
        assert body["param"] == "guided_regex" and body["code"] == "grammar_compile_timeout", body
        assert "took more than 0.05 s" in body["message"]
    text, finish = chat_text(server, temperature=0, extra_body={"structured_outputs": {"regex": REGEX}})
    assert finish == "stop" and re.fullmatch(REGEX, text)
