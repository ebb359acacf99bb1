"""One chat request's tools: what the chat template is given, what the output is forced to, and how
the model's text becomes OpenAI tool calls (whole, or streamed as delta.tool_calls).

tool_choice decides the mode:
- "auto" (the default when tools are given): the model writes text or calls in its own format, read
  by the server's --tool-call-parser (serving/tool_calls.py: hermes, llama3_json, mistral, pythonic).
- "required": the output is forced by structured outputs to a JSON array of one or more
  {"name", "parameters"} objects, one of the tools each (at most one unless parallel_tool_calls).
- a named function: the output is forced to that function's arguments object.
- "none": the tools are not shown and nothing is parsed.
A chat template that never mentions `tools` (the demo model's, and many small models') would drop
them silently; such a template gets them as a system message in the parser's own format instead
(tool_prompt), and earlier calls and results as text it can render.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from jaxsched.errors import InvalidRequestError
from jaxsched.structured.params import StructuredOutputsParams
from serving.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    RequestError,
    ToolCallOut,
)
from serving.tool_calls import (
    PARSERS,
    JsonToolParser,
    NamedCallStream,
    StreamUpdate,
    ToolCall,
    call_from_named,
    calls_from_required,
    find_tool,
    named_tool_schema,
    required_tools_schema,
    validate_tools,
)

DEFAULT_TOOL_PARSER = "hermes"

# How each parser's format is explained to a model whose template does not take tools
_FORMATS = {
    "hermes": 'To call one, write <tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>',
    "llama3_json": 'To call one, write only {"name": <function name>, "parameters": <arguments object>}',
    "mistral": 'To call one, write [TOOL_CALLS][{"name": <function name>, "arguments": <arguments object>}]',
    "pythonic": "To call one, write only [function_name(argument=value, ...)] with Python literal values",
}


def template_takes_tools(template: Any) -> bool:
    """Whether a chat template (a string, or transformers' dict of named templates) reads `tools`."""
    if isinstance(template, dict):
        return any(template_takes_tools(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def tool_prompt(tools: list[dict], parser: str) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return f"You can call these functions:\n<tools>\n{listing}\n</tools>\n{_FORMATS.get(parser, _FORMATS['hermes'])}"


def as_text_call(call: dict[str, Any]) -> str:
    """An earlier assistant tool call as the text a hermes-style model writes."""
    fn = call.get("function", {})
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")},
                                        ensure_ascii=False) + "\n</tool_call>"


@dataclass
class ChatTools:
    tools: list[dict]  # OpenAI tool objects, as the template receives them
    mode: str  # "auto", "required" or "named"
    parser: str  # the --tool-call-parser ("auto" mode)
    name: str | None = None  # the named function
    parallel: bool = True
    _streams: dict[int, Any] = field(default_factory=dict)  # choice index -> its stream parser
    _texts: dict[int, str] = field(default_factory=dict)  # choice index -> the text so far
    _called: set[int] = field(default_factory=set)  # choice indices that streamed a call

    @classmethod
    def from_request(cls, req: ChatCompletionRequest, parser: str | None) -> ChatTools | None:
        """The request's tools, validated (400 naming the field), or None when it has none or
        tool_choice is "none"."""
        tools = [msgspec.to_builtins(t) for t in req.tools or ()]
        choice = msgspec.to_builtins(req.tool_choice) if req.tool_choice is not None else None
        try:
            validate_tools(tools or None, choice, req.parallel_tool_calls)
        except ValueError as e:
            msg = str(e)
            raise RequestError(msg, param="tool_choice" if msg.startswith("tool_choice") else "tools") from e
        if not tools or choice == "none":
            return None
        parallel = req.parallel_tool_calls is not False
        if choice in (None, "auto"):
            if parser is None:
                raise RequestError("tool_choice \"auto\" needs a tool-call parser: start the server with "
                                   f"--tool-call-parser (one of {', '.join(sorted(PARSERS))}), or pass tool_choice "
                                   "\"required\" or a named function", param="tool_choice")
            return cls(tools, "auto", parser, parallel=parallel)
        if choice == "required":
            return cls(tools, "required", parser or DEFAULT_TOOL_PARSER, parallel=parallel)
        return cls(tools, "named", parser or DEFAULT_TOOL_PARSER, name=choice["function"]["name"], parallel=parallel)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """What forces the output in "required" and named modes (a JSON Schema); None for auto.
        A schema the engine refuses (too large) is a 400 naming `tools`."""
        try:
            if self.mode == "named":
                return StructuredOutputsParams(json=named_tool_schema(find_tool(self.tools, self.name)))
            if self.mode == "required":
                return StructuredOutputsParams(json=required_tools_schema(self.tools, self.parallel))
        except InvalidRequestError as e:
            raise RequestError(f"the tools' schema cannot be enforced: {e}", param="tools") from e
        return None

    # -- a finished choice ---------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output; text the parser cannot read stays content."""
        try:
            if self.mode == "named":
                return None, [call_from_named(self.name, text)]
            if self.mode == "required":
                return None, calls_from_required(text)
        except ValueError:  # cut short (max_tokens, a stop string): the whole calls, else the text as written
            calls = JsonToolParser.complete_calls(text) if self.mode == "required" else []
            return (None, calls) if calls else (text, [])
        return PARSERS[self.parser]().parse(text)

    @staticmethod
    def calls_out(calls: list[ToolCall]) -> list[ToolCallOut]:
        return [ToolCallOut(c.id, "function", FunctionCallOut(c.name, c.arguments)) for c in calls]

    # -- streaming -----------------------------------------------------------------------------
    def stream(self, index: int, new_text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
        """(content, tool call deltas) of a choice's new text, either None when there is nothing."""
        text = self._texts.get(index, "") + new_text
        self._texts[index] = text
        s = self._streams.get(index)
        if s is None:
            s = self._streams[index] = (NamedCallStream(self.name) if self.mode == "named" else
                                        PARSERS["json" if self.mode == "required" else self.parser]())
        up: StreamUpdate = s.finish(text) if finished else s.stream(text)
        deltas = []
        for d in up.calls:
            self._called.add(index)
            if d.id is not None:
                deltas.append(DeltaToolCall(d.index, d.id, "function", DeltaFunctionCall(d.name, d.arguments)))
            else:
                deltas.append(DeltaToolCall(d.index, function=DeltaFunctionCall(arguments=d.arguments)))
        return up.content or None, deltas or None

    def called(self, index: int) -> bool:
        """Whether choice `index` streamed a tool call."""
        return index in self._called


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the model ended by calling tools."""
    return "tool_calls" if called and reason == "stop" else reason
