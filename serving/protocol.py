"""OpenAI request and response schemas (plus vLLM's extensions), as msgspec Structs.

Requests are decoded in two steps, JSON to builtins and then msgspec.convert to the Struct, so that
the server can name the fields it ignores. Unknown fields are ignored and logged, as vLLM does:
clients written for other servers send extras (`user`-like tags, tool fields) that must not break a
request. Types are strict: "5" is not an int and true is not a number.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, TypeVar

import msgspec
from msgspec import Meta, Struct

from jaxsched.core.limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_CHOICES,
    MAX_DETOKENIZE_IDS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP,
    MAX_TOOLS,
)

# Lists and strings with a limit (jaxsched/core/limits.py), checked by the decoder as it converts
# the body, before any of the server's own work over them; the error names the field.
StopStrings = Annotated[list[str], Meta(max_length=MAX_STOP)]
StopIds = Annotated[list[int], Meta(max_length=MAX_STOP)]
LogitBias = Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)]
AllowedIds = Annotated[list[int], Meta(max_length=MAX_ALLOWED_TOKEN_IDS)]
Choices = Annotated[list[str], Meta(max_length=MAX_CHOICES)]
RequestId = Annotated[str, Meta(max_length=MAX_REQUEST_ID_CHARS)]
DetokenizeIds = Annotated[list[int], Meta(max_length=MAX_DETOKENIZE_IDS)]


class RequestError(Exception):
    """A client error, rendered as OpenAI's {"error": {...}} with its HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type_ or _ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}


# OpenAI's error type of each status this server answers with; the others are invalid_request_error
_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 408: "timeout_error", 429: "rate_limit_error", 500: "server_error", 503: "server_overloaded"}


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct):
    error: ErrorInfo


# -- requests ----------------------------------------------------------------------------------
# Every field of OpenAI's and vLLM's /v1/completions and /v1/chat/completions requests is declared
# here, honoured or not: serving/request_fields.py says which are honoured and refuses the others
# when they are given a value other than their default. Defaults are OpenAI's (vLLM's for its own
# fields), so a field left out and a field given its default look the same.
class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's; stream chunks are never padded here
    continuous_usage_stats: bool | None = False  # vLLM's


class JsonSchemaFormat(Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    type: str  # "text", "json_object" or "json_schema"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(Struct, kw_only=True):
    """vLLM's `structured_outputs`: at most one of json, regex, choice, grammar, json_object."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None  # declared so that it is refused rather than ignored


class FunctionDefinition(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolParam(Struct, kw_only=True):
    type: str = "function"
    function: FunctionDefinition


class FunctionName(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: str = "function"
    function: FunctionName


class _Sampling(Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions.

    JSON null means "the default" for every optional field, as in OpenAI's API (clients send
    `"n": null`); _null_defaults restores the defaults of the fields whose default is not null.
    """

    _null_defaults: ClassVar[dict[str, Any]] = {
        "n": 1, "stream": False, "min_tokens": 0, "ignore_eos": False, "priority": 0, "skip_special_tokens": True,
        "include_stop_str_in_output": False, "echo": False, "add_generation_prompt": True,
        "use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
        "return_token_offsets": False, "return_mm_kwargs": True, "routed_experts_prompt_start": 0}

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | StopStrings | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: StopIds | None = None
    priority: int | None = 0
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    allowed_token_ids: AllowedIds | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0
    watermarking: bool | None = None
    spaces_between_special_tokens: bool | None = True
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None  # "left" or "right"
    response_format: ResponseFormat | None = None  # OpenAI's on chat; vLLM takes it on completions too
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM's older spelling of structured_outputs
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    logits_processors: list[Any] | None = None  # qualified names or {"qualname": ..., "args": ..., "kwargs": ...}
    cache_salt: str | None = None
    request_id: RequestId | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    return_token_offsets: bool | None = False  # vLLM's render endpoints only
    return_mm_kwargs: bool | None = True  # vLLM's render endpoints only
    routed_experts_prompt_start: int | None = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None
    timeout: float | None = None  # this server's: seconds after which the request ends (finish_reason "timeout")

    def __post_init__(self) -> None:
        for name, default in self._null_defaults.items():
            if getattr(self, name, default) is None:
                setattr(self, name, default)


class CompletionRequest(_Sampling, kw_only=True):
    _null_defaults: ClassVar[dict[str, Any]] = {**_Sampling._null_defaults, "add_special_tokens": True}

    prompt: str | list[Any]  # a string, strings, token ids, or lists of token ids
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's extensions
    add_special_tokens: bool | None = True
    prompt_embeds: str | list[str] | None = None  # base64 tensors


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCallIn(Struct, kw_only=True):
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCallIn(Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCallIn


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallIn], Meta(max_length=MAX_TOOLS)] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # the call a "tool" message answers


class ChatCompletionRequest(_Sampling, kw_only=True):
    _null_defaults: ClassVar[dict[str, Any]] = {
        **_Sampling._null_defaults, "add_special_tokens": False, "continue_final_message": False, "store": False,
        "include_reasoning": True}

    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_MESSAGES)]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: Annotated[list[ChatCompletionToolParam], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | NamedToolChoice | None = None  # "none", "auto", "required" or a named function
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = False
    service_tier: str | None = None
    modalities: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    functions: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None  # deprecated by OpenAI in favour of tools
    function_call: str | dict[str, Any] | None = None  # deprecated by OpenAI in favour of tool_choice
    # vLLM's extensions
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False
    chat_template: str | None = None  # refused unless the server runs with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = False  # vLLM's: prepend the last message to the reply when it has the reply's role
    best_of: int | None = None  # older vLLM's
    include_reasoning: bool | None = True
    documents: list[dict[str, Any]] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    structural_tag: str | None = None  # older vLLM's
    return_prompt_text: bool | None = None


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: DetokenizeIds


# -- responses ---------------------------------------------------------------------------------
class UsageInfo(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(Struct):
    """vLLM's Logprob, as its prompt_logprobs hold it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# prompt_logprobs (vLLM's): per prompt token {token id: its PromptLogprob}, None for the first
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # asked with prompt_logprobs (whole responses)


class CompletionResponse(Struct, omit_defaults=True):
    id: str
    object: str  # "text_completion", for whole responses and stream chunks alike
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None  # stream chunks carry it only in the final usage chunk


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobEntry(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatLogprobEntry] | None


class FunctionCallOut(Struct):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(Struct):
    id: str
    type: str  # "function"
    function: FunctionCallOut


class ChatResponseMessage(Struct, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | None = None  # present only when the model called tools
    reasoning_content: str | None = None  # vLLM's: the thinking, with --reasoning-parser (serving/reasoning.py)


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Struct):
    id: str
    object: str  # "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # asked with prompt_logprobs: the rendered chat's tokens


class DeltaFunctionCall(Struct, omit_defaults=True):
    name: str | None = None  # in a call's first delta only
    arguments: str | None = None  # the next characters of the arguments' JSON


class DeltaToolCall(Struct, omit_defaults=True):
    index: int
    id: str | None = None  # in a call's first delta only, with type and the function's name
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatStreamChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(Struct, omit_defaults=True):
    id: str
    object: str  # "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # in the first chunk, when asked


class ModelCard(Struct):
    id: str
    object: str
    created: int
    owned_by: str
    root: str | None
    max_model_len: int


class ModelList(Struct):
    object: str
    data: list[ModelCard]


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Struct):
    prompt: str


# -- decoding ----------------------------------------------------------------------------------
T = TypeVar("T", bound=Struct)
# Deeper bodies are a 400. The code after decoding walks request values recursively (json.dumps
# of a schema or tool, the chat template's tojson, a schema's own conversion): far below Python's
# recursion limit (~1,000, where msgspec's decoder stops), none of them can hit it.
MAX_JSON_DEPTH = 128


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deeply lists and objects nest in a decoded JSON value (a scalar is 0, [] is 1), counted
    up to limit + 1; walked without recursion, holding one iterator per level."""
    if not isinstance(value, (list, dict)):
        return 0
    deepest = 1
    path = [iter(value.values() if isinstance(value, dict) else value)]
    while path:
        for x in path[-1]:
            if isinstance(x, (list, dict)):
                path.append(iter(x.values() if isinstance(x, dict) else x))
                deepest = max(deepest, len(path))
                if deepest > limit:
                    return deepest
                break
        else:
            path.pop()
    return deepest


def decode_request(body: bytes, typ: type[T]) -> tuple[T, list[str]]:
    """Parse a JSON body into `typ`; returns it and the names of the top-level fields it ignored.
    Raises RequestError (400) saying what was wrong and where."""
    try:
        raw = msgspec.json.decode(body)
    except RecursionError as e:
        raise RequestError(f"the request body is nested too deeply: JSON nesting is limited to {MAX_JSON_DEPTH} "
                           "levels", code="invalid_json") from e
    except Exception as e:
        raise RequestError(f"the request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(raw, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(raw).__name__}",
                           code="invalid_json")
    # (fewer brackets than the limit cannot nest past it: a prompt of token ids is not walked)
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and json_depth(raw) > MAX_JSON_DEPTH:
        raise RequestError(f"the request body is nested too deeply: JSON nesting is limited to {MAX_JSON_DEPTH} "
                           "levels", code="invalid_json")
    known = set(typ.__struct_fields__)
    unknown = sorted(k for k in raw if k not in known)
    try:
        obj = msgspec.convert(raw, typ)
    except RecursionError as e:
        raise RequestError("the request body is nested too deeply", code="invalid_json") from e
    except msgspec.ValidationError as e:
        msg = str(e)
        param = None
        if " - at `$." in msg:
            param = msg.rsplit(" - at `$.", 1)[1].rstrip("`").split("[")[0].split(".")[0]
        elif msg.startswith("Object missing required field `"):
            param = msg.split("`")[1]
        if "of length <=" in msg:  # a limit (jaxsched/core/limits.py)
            msg += ": this server's limit (see the README's limits); send less"
        raise RequestError(f"invalid request: {msg}", param=param, code="invalid_type") from e
    return obj, unknown
