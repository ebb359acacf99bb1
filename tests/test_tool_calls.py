"""serving/tool_calls.py: parsing tool calls out of model text, streamed and whole, the schemas that force
calls, and the checks of a request's tools. Pure Python: no model."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from serving.tool_calls import (
    PARSERS,
    HermesToolParser,
    JsonToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedCallStream,
    PythonicToolParser,
    StreamUpdate,
    ToolParser,
    call_from_named,
    calls_from_required,
    find_tool,
    named_tool_schema,
    new_call_id,
    required_tools_schema,
    validate_tools,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]

LONG_ARGS = json.dumps({"city": "Paris", "notes": "x" * 150, "days": 3, "nested": {"a": [1, 2, {"b": "}"}]}})


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


HERMES_TEXTS = [
    hermes("get_weather", '{"city": "Paris"}'),
    "Let me check both.\n" + hermes("get_weather", LONG_ARGS) + "\n" + hermes("get_time", "{}") + "\nDone.",
    # arguments as a string holding JSON, with escapes and a surrogate pair
    hermes("get_weather", json.dumps(json.dumps({"city": "Zürich \"Z\" \U0001f600"}))),
    # arguments before the name, a function without arguments, an unterminated last call
    ('<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>'
     '<tool_call>{"name": "get_time"}</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'),
    "Plain text with a < and a <tooth> and <tool but no call <",
    "<tool_call>\nnot json at all\n</tool_call>",
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name: content
    "",
]
LLAMA_TEXTS = [
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ' {"name": "get_weather", "parameters": ' + LONG_ARGS + '}; {"name": "get_time", "arguments": {}} ',
    '{"name": "get_time", "parameters": "{\\"tz\\": \\"UTC\\"}"};',
    "The answer is 42.",
    '{"answer": 42, "unit": "none"}',  # JSON but not a call: content
    "<|python_tag|>print('hello')",
]
JSON_TEXTS = [
    json.dumps([{"name": "get_weather", "parameters": json.loads(LONG_ARGS)},
                {"name": "get_time", "parameters": {}}]),
    json.dumps([{"name": "get_weather", "parameters": {"city": "Rome"}}], indent=2),
    '{"name": "get_time", "parameters": {}}',  # not an array: content
]
MISTRAL_TEXTS = [
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + LONG_ARGS + '}, {"name": "get_time", "arguments": {}}]',
    'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    '[{"name": "get_time", "arguments": {}}]',  # the tag dropped with the special tokens
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',  # tokenizer v11
    "[TOOL_CALLS]get_weather[ARGS]{broken",
    "No call here [TOOL_CALL] but brackets [1, 2].",
    "[1, 2, 3]",
]
PYTHONIC_TEXTS = [
    '[get_weather(city="Paris", days=3), get_time()]',
    '<|python_start|>[get_weather(city="Zürich \\"Z\\"", nested={"a": [1, 2.5, None, True]})]<|python_end|>',
    " [get_time()] ",
    "[get_weather('Paris')]",  # a positional argument: content
    "[os.system(cmd)]",  # a name, not a literal: content
    "[1, 2]",
    "The answer is [42].",
    "Sure, here it is.",
]
CASES = ([(HermesToolParser, t) for t in HERMES_TEXTS] + [(Llama3JsonToolParser, t) for t in LLAMA_TEXTS]
         + [(JsonToolParser, t) for t in JSON_TEXTS] + [(MistralToolParser, t) for t in MISTRAL_TEXTS]
         + [(PythonicToolParser, t) for t in PYTHONIC_TEXTS])


def feed(parser: ToolParser, text: str, ends: list[int]) -> list[StreamUpdate]:
    return [parser.stream(text[:end]) for end in ends] + [parser.finish(text)]


def random_ends(text: str, seed: int) -> list[int]:
    rng, ends, end = random.Random(seed), [], 0
    while end < len(text):
        end = min(len(text), end + rng.randint(1, 9))
        ends.append(end)
    return ends


def assemble(updates: list[StreamUpdate]) -> tuple[str, list[list[str]]]:
    """The streamed content and [name, arguments] per call, checking OpenAI's delta shape on the way."""
    calls: list[list[str]] = []
    for delta in (d for u in updates for d in u.calls):
        if delta.index == len(calls):  # a new call: its first delta names it
            assert re.fullmatch(r"call_[0-9a-zA-Z]{24}", delta.id or ""), delta
            assert delta.name
            calls.append([delta.name, delta.arguments])
        else:
            assert delta.index < len(calls) and delta.id is None and delta.name is None, delta
            calls[delta.index][1] += delta.arguments
    return "".join(u.content for u in updates), calls


@pytest.mark.parametrize(("cls", "text"), CASES)
@pytest.mark.parametrize("chunking", ["by character", "seed 0", "seed 1"])
def test_stream_adds_up_to_parse(cls, text, chunking):
    if chunking == "by character":
        ends = list(range(1, len(text) + 1))
    else:
        ends = random_ends(text, int(chunking[-1]))
    content, calls = assemble(feed(cls(), text, ends))
    want_content, want_calls = cls().parse(text)
    assert calls == [[c.name, c.arguments] for c in want_calls]
    if want_calls:
        assert (content.strip() or None) == want_content
    else:
        assert content == text == want_content


def test_arguments_are_streamed_as_written():
    text = HERMES_TEXTS[1]
    parser = HermesToolParser()
    middle = text.index('"notes"') + 40
    before = assemble([parser.stream(text[:end]) for end in range(1, middle)])[1]
    assert before[0][0] == "get_weather" and 40 < len(before[0][1]) and LONG_ARGS.startswith(before[0][1])
    pieces = [d.arguments for u in feed(HermesToolParser(), text, random_ends(text, 2)) for d in u.calls
              if d.index == 0 and d.arguments]
    assert len(pieces) > 5


def test_parse_hermes():
    content, calls = HermesToolParser().parse(HERMES_TEXTS[1])
    assert content == "Let me check both.\n\n\nDone."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", LONG_ARGS), ("get_time", "{}")]
    assert calls[0].id != calls[1].id

    # the raw arguments text, not re-serialized
    _, calls = HermesToolParser().parse(hermes("f", '{ "a" :1 }'))
    assert calls[0].arguments == '{ "a" :1 }'

    _, calls = HermesToolParser().parse(HERMES_TEXTS[2])
    assert json.loads(calls[0].arguments) == {"city": "Zürich \"Z\" \U0001f600"}

    content, calls = HermesToolParser().parse(HERMES_TEXTS[3])
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}'), ("get_time", "{}"), ("get_time", "{}")]


@pytest.mark.parametrize("text", [
    hermes("f", '{"a": }'),  # broken JSON
    hermes("f", '"not json"'),  # a string that holds no JSON object
    hermes("f", "[1, 2]"),
    "<tool_call>\n" + '{"name": "f", "arguments": {"a": 1}',  # unterminated and incomplete
    hermes("f", "{}") + hermes("g", "{"),  # one broken call spoils all, as in vLLM
    hermes("f", "{}").replace("</tool_call>", "trailing text"),
    "no calls here",
])
def test_parse_hermes_gives_back_what_is_no_call(text):
    assert HermesToolParser().parse(text) == (text, [])


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_output_nested_deeper_than_pythons_parser_is_no_call(parser):
    """A model can write brackets thousands deep; json.loads then raises RecursionError, which must
    read as "not a call" (the text comes back as content), not fail the response."""
    deep = "[" * 5000 + "]" * 5000
    texts = ['<tool_call>\n{"name": "f", "arguments": ' + deep + "}\n</tool_call>",
             '{"name": "f", "parameters": ' + deep + "}", '[{"name": "f", "arguments": ' + deep + "}]",
             "<tool_call>\n{" + deep + "}\n</tool_call>", "{" + deep + "}",  # where a key goes
             '<tool_call>\n{"name": ' + deep + "}\n</tool_call>", '{"name": ' + deep + "}"]  # as the name
    for i, text in enumerate(texts):
        content, calls = PARSERS[parser]().parse(text)
        assert calls == [] and content == text
        # streamed: no error either; a call whose name came before its arguments was sent as it
        # streamed (as any call whose arguments turn out broken), one with no readable name never
        content, calls = assemble(feed(PARSERS[parser](), text, list(range(100, len(text), 997)) + [len(text)]))
        assert calls == [] or (i < 3 and [name for name, _ in calls] == ["f"])
    with pytest.raises(ValueError, match="not JSON"):
        call_from_named("f", deep)


def test_parse_llama3():
    content, calls = Llama3JsonToolParser().parse(LLAMA_TEXTS[0])
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    _, calls = Llama3JsonToolParser().parse(LLAMA_TEXTS[1])
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", LONG_ARGS), ("get_time", "{}")]
    _, calls = Llama3JsonToolParser().parse(LLAMA_TEXTS[2])
    assert calls[0].arguments == '{"tz": "UTC"}'
    not_calls = ['{"name": "f", "parameters": {"a": 1}', 'Sure: {"name": "f", "parameters": {}}']
    for text in LLAMA_TEXTS[3:] + not_calls:
        assert Llama3JsonToolParser().parse(text) == (text, [])


def test_parse_json_array():
    content, calls = JsonToolParser().parse(JSON_TEXTS[1])
    assert content is None
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    one = '[{"name": "f", "parameters": {}}'
    for text in (JSON_TEXTS[2], "[]", one + "] extra", one):
        assert JsonToolParser().parse(text) == (text, [])
    assert set(PARSERS) >= {"hermes", "llama3_json", "json", "mistral", "pythonic"}


def test_parse_mistral():
    content, calls = MistralToolParser().parse(MISTRAL_TEXTS[0])
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", LONG_ARGS),
                                                                          ("get_time", "{}")]
    content, calls = MistralToolParser().parse(MISTRAL_TEXTS[1])
    assert content == "Let me look." and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert [c.name for c in MistralToolParser().parse(MISTRAL_TEXTS[2])[1]] == ["get_time"]
    _, calls = MistralToolParser().parse(MISTRAL_TEXTS[3])
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    for text in MISTRAL_TEXTS[4:]:
        assert MistralToolParser().parse(text) == (text, [])
    streamed = assemble(feed(MistralToolParser(), MISTRAL_TEXTS[0], list(range(1, len(MISTRAL_TEXTS[0])))))
    assert streamed[1][0] == ["get_weather", LONG_ARGS]


def test_mistral_streams_an_array_call_as_it_is_written():
    text = MISTRAL_TEXTS[0]
    parser = MistralToolParser()
    middle = text.index('"notes"') + 40
    before = assemble([parser.stream(text[:end]) for end in range(1, middle)])[1]
    assert before[0][0] == "get_weather" and 40 < len(before[0][1]) and LONG_ARGS.startswith(before[0][1])


def test_parse_pythonic():
    _, calls = PythonicToolParser().parse(PYTHONIC_TEXTS[0])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3}),
                                                                  ("get_time", {})]
    content, calls = PythonicToolParser().parse(PYTHONIC_TEXTS[1])
    assert content is None and json.loads(calls[0].arguments) == {"city": 'Zürich "Z"',
                                                                  "nested": {"a": [1, 2.5, None, True]}}
    for text in PYTHONIC_TEXTS[3:]:
        assert PythonicToolParser().parse(text) == (text, [])


def test_content_that_may_be_a_tag_is_held_back():
    parser = HermesToolParser()
    assert parser.stream("Sure. <tool").content == "Sure."
    assert parser.stream("Sure. <tool_c").content == ""
    update = parser.stream("Sure. <tool_call>\n")
    assert update.content == "" and update.calls == []
    update = parser.stream('Sure. <tool_call>\n{"name": "get_time"')
    assert update.content == "" and [(d.index, d.name) for d in update.calls] == [(0, "get_time")]

    parser = HermesToolParser()
    assert parser.stream("Hi <too").content == "Hi"
    assert parser.stream("Hi <tooth").content == " <tooth"
    assert parser.finish("Hi <tooth <").content == " <"

    parser = Llama3JsonToolParser()
    assert parser.stream("<|python").content == ""
    assert parser.stream("<|pythonic").content == "<|pythonic"


def test_json_array_names_a_call_once_its_name_is_complete():
    parser = JsonToolParser()
    assert parser.stream('[{"name": "get_wea').calls == []
    update = parser.stream('[{"name": "get_weather", "parameters": {"ci')
    assert [(d.index, d.name, d.arguments) for d in update.calls] == [(0, "get_weather", '{"ci')]
    update = parser.stream('[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time"')
    assert [(d.index, d.name, d.arguments) for d in update.calls] == [
        (0, None, 'ty": "Rome"}'), (1, "get_time", "")]


def test_a_call_broken_after_its_name_stays_sent():
    # the stream cannot take back a call it has named; parse() gives the text as content
    text = hermes("get_time", "{") + " the end"
    parser = HermesToolParser()
    _, calls = assemble(feed(parser, text, list(range(1, len(text)))))
    assert [c[0] for c in calls] == ["get_time"] and parser.parse(text) == (text, [])


def test_new_call_id():
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"call_[0-9a-zA-Z]{24}", i) for i in ids)


# -- forced calls -----------------------------------------------------------------------------------------
def test_required_tools_schema():
    schema = required_tools_schema(TOOLS, parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}},
            {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    jsonschema.validate(good[:1], required_tools_schema(TOOLS, parallel=False))
    bad = {
        "wrong name": [{"name": "get_wether", "parameters": {"city": "Paris"}}],
        "missing parameters": [{"name": "get_time"}],
        "parameters against their schema": [{"name": "get_weather", "parameters": {"days": 2}}],
        "an extra member": [{"name": "get_time", "parameters": {}, "id": 1}],
        "no call": [],
    }
    for what, value in bad.items():
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
            pytest.fail(what)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, required_tools_schema(TOOLS, parallel=False))

    calls = calls_from_required(json.dumps(good))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(g["name"], g["parameters"]) for g in good]
    for text in ("[]", "not json", '{"name": "get_time", "parameters": {}}'):
        with pytest.raises(ValueError, match="not a JSON array"):
            calls_from_required(text)


def test_named_tool_schema_and_stream():
    assert named_tool_schema(WEATHER) == WEATHER["function"]["parameters"]
    assert named_tool_schema(TIME) == {"type": "object"}
    text = "\n " + LONG_ARGS + " \n"
    call = call_from_named("get_weather", text)
    assert (call.name, call.arguments) == ("get_weather", LONG_ARGS)
    jsonschema.validate(json.loads(call.arguments), named_tool_schema(WEATHER))

    stream = NamedCallStream("get_weather")
    updates = feed(stream, text, random_ends(text, 3))
    deltas = [d for u in updates for d in u.calls]
    assert (deltas[0].index, deltas[0].id, deltas[0].name) == (0, stream.id, "get_weather")
    assert all((d.index, d.id, d.name) == (0, None, None) for d in deltas[1:]) and len(deltas) > 5
    assert "".join(d.arguments for d in deltas) == call.arguments

    for text, message in (("not json", "not JSON"), ("[1]", "JSON list")):
        with pytest.raises(ValueError, match=message):
            call_from_named("get_weather", text)


# -- requests ---------------------------------------------------------------------------------------------
def function(**fields) -> dict:
    return {"type": "function", "function": {"name": "f", **fields}}


@pytest.mark.parametrize(("tools", "choice", "parallel", "message"), [
    ({"type": "function"}, None, None, "tools must be a list"),
    ([{"type": "retrieval"}], None, None, r"tools\[0\] must be"),
    ([{"type": "function"}], None, None, r"tools\[0\].function must be an object"),
    ([function(name="get weather")], None, None, "1 to 64 letters"),
    ([function(name="f" * 65)], None, None, "1 to 64 letters"),
    ([function(name=7)], None, None, "1 to 64 letters"),
    ([WEATHER, TIME, WEATHER], None, None, r"tools\[2\].function.name 'get_weather' is the name of another"),
    ([function(parameters=["city"])], None, None, "JSON Schema object"),
    ([function(description=3)], None, None, "description must be a string"),
    (TOOLS, "sometimes", None, "tool_choice must be"),
    (TOOLS, {"type": "function"}, None, "tool_choice must be"),
    (TOOLS, {"type": "function", "function": {"name": "get_date"}}, None, "not one of the tools"),
    (None, "auto", None, "needs tools"),
    ([], {"type": "function", "function": {"name": "f"}}, None, "needs tools"),
    (TOOLS, "auto", "yes", "parallel_tool_calls must be"),
])
def test_validate_tools_refuses(tools, choice, parallel, message):
    with pytest.raises(ValueError, match=message):
        validate_tools(tools, choice, parallel)


@pytest.mark.parametrize(("tools", "choice", "parallel"), [
    (None, None, None), ([], "none", False), (TOOLS, "auto", True), (TOOLS, "required", None),
    (TOOLS, {"type": "function", "function": {"name": "get_time"}}, None),
    ([function(description=None, parameters=None)], None, None),
])
def test_validate_tools_accepts(tools, choice, parallel):
    validate_tools(tools, choice, parallel)


def test_find_tool():
    assert find_tool(TOOLS, "get_time") is TIME
    with pytest.raises(ValueError, match="no tool is named 'get_date'"):
        find_tool(TOOLS, "get_date")


def test_a_cut_off_required_call_list_returns_its_complete_calls():
    """tool_choice "required" cut by max_tokens: the whole calls before the cut come back as
    tool_calls (finish_reason stays "length"), not the text as content."""
    from serving.chat_tools import ChatTools

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
    ct = ChatTools(tools, "required", "hermes")
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}, {"name": "a", "param'
    content, calls = ct.parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    content, calls = ct.parse('[{"name": "a", "parame')  # nothing whole: the text as written
    assert content == '[{"name": "a", "parame' and calls == []
