"""What this server does with each field of an OpenAI /v1/completions or /v1/chat/completions request.

Every field of OpenAI's two request types and of vLLM's extensions to them is in FIELDS, either
honoured or refused: a refused field given a value other than its default is answered with a 400
that names it, so no such field is ever silently ignored. (Fields outside OpenAI's and vLLM's are
still ignored and logged, see protocol.decode_request.) tests/test_request_fields.py keeps FIELDS,
the request Structs of serving/protocol.py and openai-python's parameter types in step.

A row names a top-level field, or a field of a nested object by its dotted path
("stream_options.continuous_usage_stats"); a nested field of an absent object is at its default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from serving.protocol import RequestError

HONOURED = "honoured"
REFUSED = "refused"
COMPLETIONS = "completions"
CHAT = "chat"
ROUTES = (COMPLETIONS, CHAT)
BOTH = ROUTES

_ROUTE_PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}


@dataclass(frozen=True)
class RequestField:
    """One field of one or both routes.

    status: HONOURED (the server does what the field asks) or REFUSED (only its default is taken).
    reason: for a refused field, why, shown in the 400; for an honoured field with `accept`, why the
        other values are refused.
    accept: values besides null and the field's default that are taken, as a predicate of (value,
        request). On a refused field these are the values that mean the default (`false` for a flag
        whose default is null); on an honoured field it limits the honoured values, and the others
        are refused with `reason`.
    note: what the README table says (the reason where there is no note).
    """

    name: str
    routes: tuple[str, ...]
    source: str  # "openai", "vllm" or "jaxsched" (this server's own)
    status: str
    reason: str = ""
    accept: Callable[[Any, Any], bool] | None = None
    note: str = ""

    @property
    def checked(self) -> bool:
        """Whether refuse_unsupported looks at this field."""
        return self.status == REFUSED or self.accept is not None


def _one_of(*values: Any) -> Callable[[Any, Any], bool]:
    return lambda value, req: any(value == v and type(value) is type(v) for v in values)


def _equal_to_n(value: Any, req: Any) -> bool:
    return value == req.n


def _default_cache_options(value: Any, req: Any) -> bool:
    """OpenAI's default prompt caching, spelt out: an implicit breakpoint kept for 30 minutes."""
    return isinstance(value, dict) and all(
        {"mode": "implicit", "ttl": "30m"}.get(k, object()) == v for k, v in value.items())


def _f(name: str, routes: tuple[str, ...], source: str, status: str = HONOURED, reason: str = "",
       accept: Callable[[Any, Any], bool] | None = None, note: str = "") -> RequestField:
    return RequestField(name, routes, source, status, reason, accept, note)


_LOGPROB_IDS = "log-probabilities of chosen token ids are not implemented: use logprobs/top_logprobs"
_NO_BEAM = "beam search is not implemented"
_NO_MM = "this server takes text only: it has no multimodal inputs"
_RENDER_ONLY = "only for vLLM's render endpoints; vLLM ignores it on this route, and so does this server"
_ID_ONLY = "accepted; an identifier that does not change the output (like `user`)"
_STRUCTURAL_TAG = "vLLM's structural tags are not supported: use a JSON schema, regex, choice or grammar"

FIELDS: tuple[RequestField, ...] = (
    # -- OpenAI's, on both routes ----------------------------------------------------------------
    _f("model", BOTH, "openai"),
    _f("frequency_penalty", BOTH, "openai"),
    _f("presence_penalty", BOTH, "openai"),
    _f("logit_bias", BOTH, "openai", note="on the device; at most 300 entries, values in [-100, 100]"),
    _f("max_tokens", BOTH, "openai"),
    _f("n", BOTH, "openai"),
    _f("seed", BOTH, "openai"),
    _f("stop", BOTH, "openai"),
    _f("stream", BOTH, "openai"),
    _f("stream_options", BOTH, "openai"),
    _f("stream_options.include_obfuscation", BOTH, "openai",
       note="accepted; stream chunks are never padded (OpenAI pads them against a side channel of its network)"),
    _f("temperature", BOTH, "openai"),
    _f("top_p", BOTH, "openai"),
    _f("user", BOTH, "openai", note="accepted; stored nowhere"),
    _f("logprobs", BOTH, "openai"),
    # -- OpenAI's, /v1/completions ---------------------------------------------------------------
    _f("prompt", (COMPLETIONS,), "openai"),
    _f("echo", (COMPLETIONS,), "openai"),
    _f("best_of", (COMPLETIONS,), "openai", note="only equal to n (best-of-n sampling is not implemented)"),
    _f("suffix", (COMPLETIONS,), "openai", REFUSED, "inserting text before a suffix is not implemented"),
    # -- OpenAI's, /v1/chat/completions ----------------------------------------------------------
    _f("messages", (CHAT,), "openai"),
    _f("max_completion_tokens", (CHAT,), "openai"),
    _f("top_logprobs", (CHAT,), "openai"),
    _f("response_format", BOTH, "openai", note="vLLM takes it on /v1/completions too"),
    _f("response_format.type", BOTH, "openai", reason="only \"text\", \"json_object\" and \"json_schema\" are "
       "implemented, not vLLM's structural tags",
       accept=_one_of("text", "json_object", "json_schema"), note="text, json_object or json_schema"),
    _f("tools", (CHAT,), "openai", note="to the chat template, or a system message where it takes none"),
    _f("tool_choice", (CHAT,), "openai", note="none, auto (--tool-call-parser), required and named are forced"),
    _f("parallel_tool_calls", (CHAT,), "openai"),
    _f("metadata", (CHAT,), "openai", note="accepted and stored nowhere, as OpenAI does without `store`"),
    _f("store", (CHAT,), "openai", reason="this server stores no completions: only false is accepted",
       accept=_one_of(False), note="only false: this server stores no completions"),
    _f("service_tier", (CHAT,), "openai", reason="this server has one service tier: only \"auto\" and \"default\" "
       "are accepted", accept=_one_of("auto", "default"), note="only \"auto\" and \"default\""),
    _f("modalities", (CHAT,), "openai", reason="this server generates text only: only [\"text\"] is accepted",
       accept=_one_of(["text"]), note="only [\"text\"]"),
    _f("prompt_cache_key", (CHAT,), "openai",
       note="accepted; prompts share cached prefixes whatever their key (automatic prefix caching)"),
    _f("safety_identifier", (CHAT,), "openai", note=_ID_ONLY),
    _f("prompt_cache_options", (CHAT,), "openai", REFUSED,
       "prefix caching is automatic here, with no explicit breakpoints or lifetimes",
       accept=_default_cache_options),
    _f("prompt_cache_retention", (CHAT,), "openai", REFUSED,
       "cached prefixes are kept only while the KV cache has room; no lifetime can be promised"),
    _f("reasoning_effort", (CHAT,), "openai", REFUSED,
       "this server has no reasoning-effort control: pass the model's own switch in chat_template_kwargs "
       "if its chat template has one"),
    _f("verbosity", (CHAT,), "openai", REFUSED, "this server has no verbosity control"),
    _f("audio", (CHAT,), "openai", REFUSED, "audio output is not implemented: this server generates text only"),
    _f("prediction", (CHAT,), "openai", REFUSED, "predicted outputs are not implemented"),
    _f("web_search_options", (CHAT,), "openai", REFUSED, "this server has no web search"),
    _f("moderation", (CHAT,), "openai", REFUSED, "this server runs no moderation"),
    _f("functions", (CHAT,), "openai", REFUSED, "deprecated by OpenAI; use tools and tool_choice"),
    _f("function_call", (CHAT,), "openai", REFUSED, "deprecated by OpenAI; use tools and tool_choice"),
    # -- vLLM's, on both routes ------------------------------------------------------------------
    _f("top_k", BOTH, "vllm"),
    _f("min_p", BOTH, "vllm"),
    _f("repetition_penalty", BOTH, "vllm"),
    _f("min_tokens", BOTH, "vllm"),
    _f("ignore_eos", BOTH, "vllm"),
    _f("stop_token_ids", BOTH, "vllm"),
    _f("priority", BOTH, "vllm", note="non-zero is a 400 unless the server runs --scheduling-policy priority"),
    _f("skip_special_tokens", BOTH, "vllm"),
    _f("include_stop_str_in_output", BOTH, "vllm"),
    _f("allowed_token_ids", BOTH, "vllm"),
    _f("structured_outputs", BOTH, "vllm", note="json, json_object, regex, choice, grammar (Lark or GBNF)"),
    _f("structured_outputs.structural_tag", BOTH, "vllm", REFUSED, _STRUCTURAL_TAG),
    _f("guided_json", BOTH, "vllm", note="vLLM's older spelling of structured_outputs.json"),
    _f("guided_regex", BOTH, "vllm", note="vLLM's older spelling of structured_outputs.regex"),
    _f("guided_choice", BOTH, "vllm", note="vLLM's older spelling of structured_outputs.choice"),
    _f("guided_grammar", BOTH, "vllm", note="vLLM's older spelling of structured_outputs.grammar"),
    _f("guided_decoding_backend", BOTH, "vllm"),
    _f("guided_whitespace_pattern", BOTH, "vllm",
       note="vLLM's older spelling of structured_outputs.whitespace_pattern"),
    _f("add_special_tokens", BOTH, "vllm"),
    _f("truncate_prompt_tokens", BOTH, "vllm"),
    _f("cache_salt", BOTH, "vllm"),
    _f("timeout", BOTH, "jaxsched", note="seconds after arrival when the request ends, with finish_reason "
       "\"timeout\" and what it has generated (its blocks freed)"),
    _f("request_id", BOTH, "vllm"),
    _f("session_id", BOTH, "vllm", note=_ID_ONLY),
    _f("return_token_offsets", BOTH, "vllm", note=_RENDER_ONLY),
    _f("return_mm_kwargs", BOTH, "vllm", note=_RENDER_ONLY),
    _f("prompt_logprobs", BOTH, "vllm",
       note="per choice on completions, at the top on chat, in a stream's first chunk; the first token's entry is "
       "null; at most the server's max_logprobs; the whole prompt is computed, not taken from the prefix cache"),
    _f("logprob_token_ids", BOTH, "vllm", REFUSED, _LOGPROB_IDS),
    _f("bad_words", BOTH, "vllm", REFUSED, "word bans are not implemented: logit_bias can ban tokens"),
    _f("use_beam_search", BOTH, "vllm", REFUSED, _NO_BEAM),
    _f("length_penalty", BOTH, "vllm", REFUSED, f"it applies to beam search, and {_NO_BEAM}"),
    _f("watermarking", BOTH, "vllm", REFUSED, "watermarking is not implemented", accept=_one_of(False)),
    _f("spaces_between_special_tokens", BOTH, "vllm", REFUSED,
       "text is decoded as the tokenizer decodes it: the spacing around special tokens cannot be changed"),
    _f("truncation_side", BOTH, "vllm", REFUSED,
       "truncate_prompt_tokens keeps the last tokens of the prompt (\"left\") and nothing else is implemented",
       accept=_one_of("left")),
    _f("logits_processors", BOTH, "vllm", REFUSED, "requests cannot load logits processors into this server"),
    _f("return_tokens_as_token_ids", BOTH, "vllm", REFUSED,
       "log-probability tokens are always given as text", accept=_one_of(False)),
    _f("return_token_ids", BOTH, "vllm", REFUSED, "responses do not carry token ids", accept=_one_of(False)),
    _f("routed_experts_prompt_start", BOTH, "vllm", REFUSED, "routed-expert data is not returned"),
    _f("kv_transfer_params", BOTH, "vllm", REFUSED, "disaggregated prefill is not implemented"),
    _f("ec_transfer_params", BOTH, "vllm", REFUSED, "encoder-cache transfer is not implemented"),
    _f("vllm_xargs", BOTH, "vllm", REFUSED, "this server has no extensions to pass them to"),
    _f("repetition_detection", BOTH, "vllm", REFUSED, "repetition detection is not implemented"),
    _f("thinking_token_budget", BOTH, "vllm", REFUSED,
       "this server does not track where a model's reasoning ends", accept=_one_of(-1)),
    _f("stream_interval", BOTH, "vllm", REFUSED, "tokens are streamed as they are made; no interval can be set",
       accept=_one_of(1)),
    _f("stream_options.continuous_usage_stats", BOTH, "vllm", REFUSED,
       "usage is reported once, in the final chunk, with stream_options.include_usage"),
    # -- vLLM's, /v1/completions -----------------------------------------------------------------
    _f("prompt_embeds", (COMPLETIONS,), "vllm", REFUSED,
       "prompt embeddings are not accepted: send text or token ids"),
    # -- vLLM's, /v1/chat/completions ------------------------------------------------------------
    _f("add_generation_prompt", (CHAT,), "vllm"),
    _f("continue_final_message", (CHAT,), "vllm"),
    _f("chat_template", (CHAT,), "vllm", note="only where the server runs with --trust-request-chat-template"),
    _f("chat_template_kwargs", (CHAT,), "vllm"),
    _f("echo", (CHAT,), "vllm", REFUSED, "echoing the last message in the reply is not implemented"),
    _f("best_of", (CHAT,), "vllm", REFUSED, "best-of-n sampling is not implemented: leave it unset or equal to n",
       accept=_equal_to_n),
    _f("include_reasoning", (CHAT,), "vllm", note="false only where the server runs with --reasoning-parser, "
       "which separates the reasoning it leaves out"),
    _f("documents", (CHAT,), "vllm", REFUSED,
       "passing retrieval documents to the chat template is not implemented"),
    _f("media_io_kwargs", (CHAT,), "vllm", REFUSED, _NO_MM),
    _f("mm_processor_kwargs", (CHAT,), "vllm", REFUSED, _NO_MM),
    _f("structural_tag", (CHAT,), "vllm", REFUSED, _STRUCTURAL_TAG),
    _f("return_prompt_text", (CHAT,), "vllm", REFUSED,
       "responses do not carry the rendered prompt: /tokenize shows its tokens", accept=_one_of(False)),
)


def fields_for(route: str) -> list[RequestField]:
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}: one of {ROUTES}")
    return [f for f in FIELDS if route in f.routes]


def _lookup(req: Any, path: str) -> tuple[Any, Any]:
    """(value, default) of a field of `req`, or of a nested object's field by dotted path; an
    absent parent object gives (None, None)."""
    obj = req
    *parents, leaf = path.split(".")
    for name in parents:
        obj = getattr(obj, name)
        if obj is None:
            return None, None
    defaults = _defaults(type(obj))
    if leaf not in defaults:
        raise AttributeError(f"{type(obj).__name__} has no field {leaf!r}")
    return getattr(obj, leaf), defaults[leaf]


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    """Each field of a msgspec Struct type with its default (None where it has none). Cached:
    msgspec.structs.fields resolves the type's annotations on every call, which done per field
    cost milliseconds a request on the event loop."""
    return {f.name: (f.default if f.default is not msgspec.NODEFAULT else None) for f in msgspec.structs.fields(cls)}


def _is_default(value: Any, default: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, (list, dict)) and not value and default in (None, [], {}):
        return True  # an empty list or object asks for nothing
    return value == default and type(value) is type(default)


def refuse_unsupported(req: Any, route: str) -> None:
    """Raise RequestError (400, code unsupported_parameter, param the field) for the first field of
    `req` that this server does not honour and that is set to something other than its default
    (null counts as the default)."""
    for f in fields_for(route):
        if not f.checked:
            continue
        value, default = _lookup(req, f.name)
        if _is_default(value, default) or (f.accept is not None and f.accept(value, req)):
            continue
        if f.status == REFUSED:
            message = (f"`{f.name}` is not supported by this server ({f.reason}): remove it or leave it at its "
                       f"default ({_json(default)})")
        else:  # honoured for some values only
            message = f"`{f.name}` cannot be {_json(value)} on this server ({f.reason})"
        raise RequestError(message, param=f.name, code="unsupported_parameter")


def _json(value: Any, limit: int = 80) -> str:
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= limit else text[:limit - 3] + "..."


def markdown_table() -> str:
    """The README's table of request fields: field | routes | status | note."""
    rows = ["| field | routes | status | note |", "| --- | --- | --- | --- |"]
    for f in sorted(FIELDS, key=lambda f: (f.name, f.routes)):
        routes = ", ".join(f"`{_ROUTE_PATHS[r]}`" for r in f.routes)
        note = (f.note or f.reason).replace("|", "\\|")
        if f.source in ("vllm", "jaxsched"):
            who = "vLLM's" if f.source == "vllm" else "this server's"
            note = f"{who} extension; {note}" if note else f"{who} extension"
        rows.append(f"| `{f.name}` | {routes} | {f.status} | {note} |")
    return "\n".join(rows) + "\n"
