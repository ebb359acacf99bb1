"""serving/request_fields.py: every field of OpenAI's and vLLM's completion requests is declared,
decided (honoured or refused), and refused with a 400 naming it when it asks for something this
server does not do."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from msgspec import inspect as mi

from serving.protocol import ChatCompletionRequest, CompletionRequest, RequestError, decode_request
from serving.request_fields import (
    CHAT,
    COMPLETIONS,
    FIELDS,
    HONOURED,
    REFUSED,
    ROUTES,
    fields_for,
    markdown_table,
    refuse_unsupported,
)

STRUCTS: dict[str, type[msgspec.Struct]] = {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest}
BASE: dict[str, dict[str, Any]] = {COMPLETIONS: {"prompt": "hi"}, CHAT: {"messages": [{"role": "user", "content": "hi"}]}}
ROUTE_FIELDS = [(route, f) for f in FIELDS for route in f.routes]


def _id(param: Any) -> str:
    route, f = param
    return f"{route}:{f.name}"


def _struct_field(cls: type, name: str) -> mi.Field:
    info = mi.type_info(cls)
    for f in info.fields:
        if f.name == name:
            return f
    raise AssertionError(f"{cls.__name__} has no field {name!r}")


def _nested_struct(t: mi.Type) -> type:
    """The Struct class in a field's type (`X | None`)."""
    for arm in t.types if isinstance(t, mi.UnionType) else (t,):
        if isinstance(arm, mi.StructType):
            return arm.cls
    raise AssertionError(f"{t} holds no Struct")


def _leaf(route: str, path: str) -> tuple[type, mi.Field]:
    """(the Struct holding the field at `path`, its msgspec field)."""
    cls: type = STRUCTS[route]
    *parents, leaf = path.split(".")
    for name in parents:
        cls = _nested_struct(_struct_field(cls, name).type)
    return cls, _struct_field(cls, leaf)


def _nest(path: str, value: Any) -> dict[str, Any]:
    *parents, leaf = path.split(".")
    obj: dict[str, Any] = {leaf: value}
    for name in reversed(parents):
        obj = {name: obj}
    return obj


def _request(route: str, path: str, value: Any) -> Any:
    raw = {**BASE[route], **_nest(path, value)}
    if path.startswith("response_format.") and path != "response_format.type":
        raw["response_format"].setdefault("type", "json_schema")
    return msgspec.convert(raw, STRUCTS[route])


def _candidates(t: mi.Type) -> list[Any]:
    """Non-null JSON values of type `t`, several where there are several kinds."""
    if isinstance(t, mi.UnionType):
        return [v for arm in t.types for v in _candidates(arm)]
    if isinstance(t, mi.BoolType):
        return [True, False]
    if isinstance(t, mi.IntType):
        return [2, 7, -3]
    if isinstance(t, mi.FloatType):
        return [0.5, 3.0]
    if isinstance(t, (mi.StrType, mi.AnyType)):
        return ["x", "right", "flex"]
    if isinstance(t, mi.ListType):
        return [[v] for v in _candidates(t.item_type)[:1]]
    if isinstance(t, mi.DictType):
        return [{"k": v} for v in _candidates(t.value_type)[:1]]
    return []


def _refused_value(route: str, f: Any) -> Any:
    """A value of the field's type that refuse_unsupported must refuse."""
    _, sf = _leaf(route, f.name)
    default = None if sf.default is msgspec.NODEFAULT else sf.default
    for v in _candidates(sf.type):
        if v == default and type(v) is type(default):
            continue
        req = _request(route, f.name, v)
        if f.accept is None or not f.accept(v, req):
            return v
    raise AssertionError(f"no value of {f.name}'s type to refuse")


# -- (a) FIELDS and the Structs agree --------------------------------------------------------------
@pytest.mark.parametrize("route_field", ROUTE_FIELDS, ids=_id)
def test_every_listed_field_is_declared(route_field: Any) -> None:
    route, f = route_field
    _leaf(route, f.name)  # raises where the Struct lacks it
    assert f.status in (HONOURED, REFUSED) and f.source in ("openai", "vllm", "jaxsched")
    assert set(f.routes) <= set(ROUTES)
    if f.checked:
        assert f.reason, f"{f.name} is refused without a reason"


@pytest.mark.parametrize("route", ROUTES)
def test_every_declared_field_is_decided(route: str) -> None:
    listed = {f.name for f in fields_for(route)}
    declared = set(STRUCTS[route].__struct_fields__)
    assert declared - listed == set(), "fields with no decision in serving/request_fields.FIELDS"
    top = {name for name in listed if "." not in name}
    assert top - declared == set()


def test_one_row_per_field_and_route() -> None:
    seen = [(route, f.name) for route, f in ROUTE_FIELDS]
    assert len(seen) == len(set(seen))


# -- (b) refused fields are refused, their defaults are not -----------------------------------------
CHECKED = [(route, f) for route, f in ROUTE_FIELDS if f.checked]


@pytest.mark.parametrize("route_field", CHECKED, ids=_id)
def test_non_default_value_is_refused(route_field: Any) -> None:
    route, f = route_field
    value = _refused_value(route, f)
    with pytest.raises(RequestError) as e:
        refuse_unsupported(_request(route, f.name, value), route)
    assert e.value.param == f.name and e.value.status == 400 and e.value.code == "unsupported_parameter"
    assert f"`{f.name}`" in e.value.message and f.reason in e.value.message


@pytest.mark.parametrize("route_field", CHECKED, ids=_id)
def test_default_and_null_are_taken(route_field: Any) -> None:
    route, f = route_field
    _, sf = _leaf(route, f.name)
    if f.name != "response_format.type":  # required there: null is no response_format.type
        refuse_unsupported(_request(route, f.name, None), route)
    if sf.default is not msgspec.NODEFAULT:
        refuse_unsupported(_request(route, f.name, sf.default), route)
    refuse_unsupported(msgspec.convert(BASE[route], STRUCTS[route]), route)


@pytest.mark.parametrize(("route", "name", "value"), [
    (CHAT, "store", False), (CHAT, "service_tier", "auto"), (CHAT, "service_tier", "default"),
    (CHAT, "modalities", ["text"]), (CHAT, "best_of", 1), (CHAT, "watermarking", False),
    (CHAT, "prompt_cache_options", {"mode": "implicit", "ttl": "30m"}), (CHAT, "prompt_cache_options", {}),
    (COMPLETIONS, "truncation_side", "left"), (COMPLETIONS, "thinking_token_budget", -1),
    (COMPLETIONS, "stream_interval", 1), (COMPLETIONS, "bad_words", []), (CHAT, "spaces_between_special_tokens", True),
    (COMPLETIONS, "response_format.type", "json_object"), (CHAT, "response_format.type", "text"),
    (COMPLETIONS, "stream_options.continuous_usage_stats", False),
    # honoured: never refused here, whatever the value
    (COMPLETIONS, "suffix", None), (CHAT, "logit_bias", {"5": -100.0}), (CHAT, "tool_choice", "required"),
    (COMPLETIONS, "best_of", 3), (CHAT, "priority", 5), (CHAT, "metadata", {"a": "b"}),
    (CHAT, "stream_options.include_obfuscation", False), (CHAT, "guided_json", {"type": "object"}),
    (CHAT, "include_reasoning", False),  # checked by the server: a 400 without --reasoning-parser
])
def test_taken_values(route: str, name: str, value: Any) -> None:
    refuse_unsupported(_request(route, name, value), route)


@pytest.mark.parametrize(("route", "name", "value"), [
    (CHAT, "store", True), (CHAT, "service_tier", "flex"), (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "best_of", 2), (CHAT, "echo", True), (COMPLETIONS, "suffix", "end"),
    (CHAT, "prompt_cache_options", {"mode": "explicit"}), (COMPLETIONS, "use_beam_search", True),
    (COMPLETIONS, "length_penalty", 0.5), (COMPLETIONS, "stream_interval", 4),
    (CHAT, "response_format.type", "structural_tag"), (CHAT, "structured_outputs.structural_tag", "{}"),
    (CHAT, "function_call", "auto"), (CHAT, "functions", [{"name": "f"}]),
])
def test_refused_values(route: str, name: str, value: Any) -> None:
    with pytest.raises(RequestError) as e:
        refuse_unsupported(_request(route, name, value), route)
    assert e.value.param == name


def test_message_names_the_default() -> None:
    with pytest.raises(RequestError) as e:
        refuse_unsupported(_request(CHAT, "spaces_between_special_tokens", False), CHAT)
    assert e.value.message.startswith("`spaces_between_special_tokens` is not supported by this server (")
    assert e.value.message.endswith("remove it or leave it at its default (true)")
    with pytest.raises(RequestError) as e:
        refuse_unsupported(_request(CHAT, "store", True), CHAT)
    assert e.value.message.startswith("`store` cannot be true on this server")


def test_first_refused_field_is_named() -> None:
    req = msgspec.convert({**BASE[CHAT], "audio": {"voice": "x"}, "use_beam_search": True}, ChatCompletionRequest)
    with pytest.raises(RequestError) as e:
        refuse_unsupported(req, CHAT)
    assert e.value.param in ("audio", "use_beam_search")


def test_unknown_route() -> None:
    with pytest.raises(ValueError):
        refuse_unsupported(msgspec.convert(BASE[CHAT], ChatCompletionRequest), "embeddings")


@pytest.mark.parametrize("route", ROUTES)
def test_checking_a_request_does_not_resolve_its_types_again(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs on the event loop for every request: resolving a Struct's annotations per
    checked field (msgspec.structs.fields) cost 9 ms per completions request and 28 per chat
    request there. Each Struct type is resolved once, however many requests come."""
    calls: list[type] = []
    real = msgspec.structs.fields
    monkeypatch.setattr(msgspec.structs, "fields", lambda cls: calls.append(cls) or real(cls))
    req = msgspec.convert(BASE[route], STRUCTS[route])
    for _ in range(20):
        refuse_unsupported(req, route)
    assert len(calls) == len(set(calls)) <= 3, f"{len(calls)} resolutions for 20 requests"


# -- (c) OpenAI's parameters are all decided ---------------------------------------------------------
def _openai_params(module: Any) -> set[str]:
    names: set[str] = set()
    for name in ("CompletionCreateParamsNonStreaming", "CompletionCreateParamsStreaming"):
        typ = getattr(module, name)
        names |= set(typ.__required_keys__) | set(typ.__optional_keys__)
    return names


@pytest.mark.parametrize("route", ROUTES)
def test_every_openai_parameter_is_decided(route: str) -> None:
    if route == CHAT:
        from openai.types.chat import completion_create_params as module
    else:
        from openai.types import completion_create_params as module
    params = _openai_params(module)
    assert {"model", "stream"} <= params  # the TypedDicts were read
    listed = {f.name for f in fields_for(route)}
    assert params - listed == set(), "OpenAI parameters missing from serving/request_fields.FIELDS"
    openai_rows = {f.name for f in fields_for(route) if f.source == "openai" and "." not in f.name}
    # an "openai" row on a route is a parameter of that route, except response_format on completions (vLLM's)
    assert openai_rows - params <= {"response_format"}


# -- decoding the new fields ----------------------------------------------------------------------------
def test_decode_tools_and_formats() -> None:
    body = msgspec.json.encode({
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
        "structured_outputs": {"choice": ["a", "b"]}, "store": None, "add_special_tokens": None})
    req, unknown = decode_request(body, ChatCompletionRequest)
    assert unknown == []
    assert req.messages[1].tool_calls[0].function.name == "f" and req.messages[2].tool_call_id == "c1"
    assert req.tools[0].function.parameters == {"type": "object"} and req.tool_choice.function.name == "f"
    assert req.response_format.json_schema.schema == {"type": "object"}
    assert req.structured_outputs.choice == ["a", "b"]
    assert req.store is False and req.add_special_tokens is False  # null is the default
    req, _ = decode_request(msgspec.json.encode({**BASE[CHAT], "tool_choice": "auto"}), ChatCompletionRequest)
    assert req.tool_choice == "auto"
    req, _ = decode_request(msgspec.json.encode({"prompt": "x", "add_special_tokens": None, "response_format":
                                                 {"type": "json_object"}}), CompletionRequest)
    assert req.add_special_tokens is True and req.response_format.type == "json_object"


def test_markdown_table() -> None:
    table = markdown_table()
    lines = table.splitlines()
    assert lines[0] == "| field | routes | status | note |"
    assert len(lines) == 2 + len(FIELDS)
    assert "| `prompt_logprobs` | `/v1/completions`, `/v1/chat/completions` | honoured |" in table
    assert "| `suffix` | `/v1/completions` | refused |" in table


def test_the_readme_table_is_the_one_the_code_renders():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert markdown_table() in readme, "README's request-field table is stale: paste serving.request_fields.markdown_table()"
