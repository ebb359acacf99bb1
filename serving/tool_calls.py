"""Tool calls for /v1/chat/completions: model text in, OpenAI tool calls out.

Models write their tool calls as text, in a format of their own (Hermes/Qwen's `<tool_call>` tags, Llama
3's bare JSON); OpenAI clients expect `tool_calls` entries with an id, a name and the arguments as a JSON
text. This module turns the one into the other, for a finished text (ToolParser.parse) and while the text
is still being generated (ToolParser.stream, then finish: OpenAI's streamed deltas, the arguments sent as
they are written). It also builds the JSON Schemas that force a call through structured output (tool_choice
"required" or a named function), reads those outputs back, and checks a request's `tools` and
`tool_choice`.

Pure Python, with no engine or jax import, so that the server and its tests need no model for it.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    """One complete call, as in a chat completion's `message.tool_calls`."""

    id: str
    name: str
    arguments: str  # the JSON text of an object, as OpenAI sends it

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A piece of one call in a streamed chunk's `delta.tool_calls`: a call's first piece carries its id and
    name, the later ones only more characters of its arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_dict(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class StreamUpdate:
    """What one stream() or finish() call adds: new content characters and new pieces of calls."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# -- an incremental JSON scanner ------------------------------------------------------------------------
_JSON_SPACE = " \t\r\n"
_SPACE = re.compile(r"[ \t\r\n]*")
_STRING_BODY = re.compile(r'[^"\\]*')
_NESTED = re.compile(r'[^"{}\[\]]*')  # what can be skipped inside a nested value: no string, no bracket
# The longest start of a JSON string's body that decodes on its own: whole escapes only, and a surrogate
# pair as one unit (its first half alone would decode to another character than the pair).
_WHOLE_ESCAPES = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?![dD][89abAB])[0-9a-fA-F]{4}'
                            r'|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})*')


def _skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


class _ObjectScan:
    """Follows one JSON object, from its `{`, as its text arrives: string and escape aware, bracket depth,
    and where each top-level member's value starts and ends in the text. It reads structure only (a
    complete object is validated with json.loads); each character is read once however often feed() is
    called with the growing text."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start  # the next character to read
        self.end = -1  # the index after the closing brace, once read
        self.spans: dict[str, list[int]] = {}  # member name -> [value start, value end or -1]
        # arguments written as a string: (its start, how far its body is decoded, the decoded text), so that
        # each character is decoded once
        self.decoded: tuple[int, int, str] = (-1, -1, "")
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._in_literal = False  # a number, true, false or null at depth 1
        self._expect = "key"  # at depth 1: "key", ":", "value" or ","
        self._reading = ""  # the depth-1 token being read: "key" or "value"
        self._token_start = -1
        self._key = ""

    def feed(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and self.end < 0:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                    i += 1
                    continue
                i = _STRING_BODY.match(text, i).end()
                if i == n:
                    break
                if text[i] == "\\":
                    self._escaped = True
                else:
                    self._in_string = False
                    if self._depth == 1:
                        self._token_done(text, i + 1)
                i += 1
                continue
            if self._depth >= 2:
                i = _NESTED.match(text, i).end()
                if i == n:
                    break
            c = text[i]
            if self._in_literal and (c in _JSON_SPACE or c in ",}]"):
                self._in_literal = False
                self._token_done(text, i)
            if c == '"':
                self._in_string = True
                if self._depth == 1:
                    self._token_begins(i)
            elif c in "{[":
                if self._depth == 1:
                    self._token_begins(i)
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._token_done(text, i + 1)
                elif self._depth == 0:
                    self.end = i + 1
            elif self._depth == 1 and not self._in_literal:
                if c == ":":
                    self._expect = "value"
                elif c == ",":
                    self._expect = "key"
                elif c not in _JSON_SPACE and self._expect == "value":
                    self._in_literal = True
                    self._token_begins(i)
            i += 1
        self.pos = i

    def _token_begins(self, i: int) -> None:
        self._token_start = i
        self._reading = "value" if self._expect == "value" else "key"
        if self._reading == "value":
            self.spans[self._key] = [i, -1]

    def _token_done(self, text: str, end: int) -> None:
        if self._reading == "value":
            self.spans[self._key][1] = end
            self._expect = ","
        elif self._reading == "key":
            try:
                self._key = json.loads(text[self._token_start:end])
            except (ValueError, RecursionError):
                self._key = ""
            self._expect = ":"
        self._reading = ""

    def name(self, text: str) -> str | None:
        """The "name" member, once its string is complete (None before, and when it is no name)."""
        start, end = self.spans.get("name", (0, -1))
        if end < 0:
            return None
        try:
            name = json.loads(text[start:end])
        except (ValueError, RecursionError):
            return None
        return name if isinstance(name, str) and name else None


def _scan_object(text: str, start: int) -> _ObjectScan | None:
    """The scan of the complete object at `start`, None when there is none."""
    if not text.startswith("{", start):
        return None
    scan = _ObjectScan(start)
    scan.feed(text)
    return scan if scan.end >= 0 else None


def _arguments_key(spans: dict[str, Any]) -> str | None:
    # Llama 3 writes "parameters", the others "arguments"; both are taken from any format
    return "arguments" if "arguments" in spans else "parameters" if "parameters" in spans else None


def _call_from_scan(text: str, scan: _ObjectScan) -> ToolCall | None:
    """The call that a complete object is, None when it is no valid call."""
    try:
        obj = json.loads(text[scan.start:scan.end])
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = _arguments_key(obj)
    value = obj[key] if key else None
    if value is None:  # a function without parameters
        arguments = "{}"
    elif isinstance(value, dict):
        start, end = scan.spans[key]
        arguments = text[start:end]  # as the model wrote it: streamed characters stay the final ones
    elif isinstance(value, str):
        try:
            if not isinstance(json.loads(value), dict):
                return None
        except (ValueError, RecursionError):
            return None
        arguments = value
    else:
        return None
    return ToolCall(new_call_id(), obj["name"], arguments)


def _arguments_so_far(text: str, scan: _ObjectScan) -> str:
    """The characters of an unfinished call's arguments that are certainly part of them."""
    key = _arguments_key(scan.spans)
    if key is None:
        return ""
    start, end = scan.spans[key]
    stop = end if end >= 0 else scan.pos
    if text[start] == "{":
        return text[start:stop]
    if text[start] == '"':  # JSON in a string: send its decoded characters, up to the last whole escape
        _, upto, decoded = scan.decoded if scan.decoded[0] == start else (start, start + 1, "")
        whole = _WHOLE_ESCAPES.match(text, upto, stop - 1 if end >= 0 else stop)
        scan.decoded = (start, whole.end(), decoded + json.loads('"' + whole.group() + '"'))
        return scan.decoded[2]
    return ""  # null or a wrong type: nothing to send before the object is complete


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _leftover(pieces: list[str]) -> str | None:
    return "".join(pieces).strip() or None


def _partial_tag(text: str, pos: int, tag: str) -> int:
    """The length of the longest end of text[pos:] that could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text) - pos), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# -- parsers --------------------------------------------------------------------------------------------
class ToolParser:
    """Reads the tool calls of one response. parse() takes a finished text; stream() is called with the
    whole text generated so far, each time longer, and finish() with the final text. Use one instance per
    response: it remembers what it has sent.

    stream() sends content and calls as soon as they are certain: content that could still be the start of
    a tool-call tag is held back, and so is whitespace until more content follows (whitespace between calls
    is not content); a call is sent once its name is complete, then its arguments as they are written.
    finish() sends whatever parse(final text) has that was not sent yet, so that all the pieces add up to
    parse()'s result (content up to leading and trailing whitespace). A call that turns out broken after its
    name was sent cannot be taken back: parse() gives the whole text as content, and finish() adds nothing.
    """

    def __init__(self) -> None:
        self._pos = 0  # how far stream() has read the text
        self._mode = "start"  # where in the format the reading is; "broken" stops it
        self._scan: _ObjectScan | None = None  # the call object being read
        self._index = -1  # that call's index, -1 until its name is known (and sent)
        self._content = ""  # the content sent so far
        self._held_space = ""  # whitespace not sent yet: sent when more content follows
        self._names: list[str] = []  # of the calls sent so far
        self._arguments: list[str] = []  # sent so far, per call

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def _advance(self, text: str, update: StreamUpdate) -> None:
        """Reads text from self._pos on, adding what is certain to `update`."""
        raise NotImplementedError

    def stream(self, text: str) -> StreamUpdate:
        update = StreamUpdate()
        self._advance(text, update)
        return update

    def finish(self, text: str) -> StreamUpdate:
        update = self.stream(text)
        content, calls = self.parse(text)
        if calls or not self._names:  # else calls were sent that parse() refuses: no text twice
            self._top_up_content(update, content or "")
        for i, call in enumerate(calls):
            if i == len(self._names):
                self._open_call(update, call.name, call.id)
            if self._names[i] == call.name:
                self._send_arguments(update, i, call.arguments)
        return update

    def _send_content(self, update: StreamUpdate, text: str) -> None:
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        update.content += body
        self._content += body

    def _top_up_content(self, update: StreamUpdate, target: str) -> None:
        # what was sent may have a leading whitespace that parse() strips
        for sent in (self._content, self._content.lstrip()):
            if target.startswith(sent):
                update.content += target[len(sent):]
                self._content += target[len(sent):]
                return

    def _open_call(self, update: StreamUpdate, name: str, call_id: str | None = None) -> int:
        self._names.append(name)
        self._arguments.append("")
        update.calls.append(ToolCallDelta(len(self._names) - 1, call_id or new_call_id(), name, ""))
        return len(self._names) - 1

    def _send_arguments(self, update: StreamUpdate, index: int, arguments: str) -> None:
        sent = self._arguments[index]
        if len(arguments) <= len(sent) or not arguments.startswith(sent):
            return
        self._arguments[index] = arguments
        if update.calls and update.calls[-1].index == index:  # one delta per call and update
            update.calls[-1].arguments += arguments[len(sent):]
        else:
            update.calls.append(ToolCallDelta(index, None, None, arguments[len(sent):]))

    def _open(self, text: str) -> bool:
        """Mode "open": a call object starts here, after whitespace. False: wait for more text, or broken."""
        self._pos = _skip_space(text, self._pos)
        if self._pos == len(text):
            return False
        if text[self._pos] != "{":
            self._mode = "broken"
            return False
        self._scan = _ObjectScan(self._pos)
        self._mode = "call"
        return True

    def _object_modes(self, text: str, update: StreamUpdate, then: str) -> bool | None:
        """The modes every format shares, "open" and "call" (`then`: the mode after a call): True to read
        on, False to wait for more text (or broken); None in any other mode."""
        if self._mode == "open":
            return self._open(text)
        if self._mode == "call":
            return self._read_call(text, update, then)
        return None

    def _read_call(self, text: str, update: StreamUpdate, then: str) -> bool:
        """Mode "call": reads the call object further. True once it is complete (the mode is then `then`)."""
        scan = self._scan
        scan.feed(text)
        if self._index < 0 and (name := scan.name(text)) is not None:
            self._index = self._open_call(update, name)
        if scan.end < 0:
            if self._index >= 0:
                self._send_arguments(update, self._index, _arguments_so_far(text, scan))
            return False
        call = _call_from_scan(text, scan)
        if call is None or self._index < 0:
            self._mode = "broken"
            return False
        self._send_arguments(update, self._index, call.arguments)
        self._pos, self._scan, self._index, self._mode = scan.end, None, -1, then
        return True


class HermesToolParser(ToolParser):
    """Hermes and Qwen: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, possibly several,
    possibly with text around them (the content). A last `<tool_call>` left unterminated at the end of the
    text still counts when its JSON is complete. Any broken call makes the whole text content, as in vLLM."""

    START = "<tool_call>"
    END = "</tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        pieces: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (at := text.find(self.START, pos)) >= 0:
            pieces.append(text[pos:at])
            scan = _scan_object(text, _skip_space(text, at + len(self.START)))
            call = scan and _call_from_scan(text, scan)
            if not call:
                return text, []
            calls.append(call)
            pos = _skip_space(text, scan.end)
            if text.startswith(self.END, pos):
                pos += len(self.END)
            elif pos < len(text):
                return text, []
        if not calls:
            return text, []
        pieces.append(text[pos:])
        return _leftover(pieces), calls

    def _advance(self, text: str, update: StreamUpdate) -> None:
        while True:
            if self._mode == "start":  # in content
                at = text.find(self.START, self._pos)
                if at < 0:
                    stop = len(text) - _partial_tag(text, self._pos, self.START)
                    self._send_content(update, text[self._pos:stop])
                    self._pos = stop
                    return
                self._send_content(update, text[self._pos:at])
                self._pos, self._mode = at + len(self.START), "open"
            elif (more := self._object_modes(text, update, then="close")) is not None:
                if not more:
                    return
            elif self._mode == "close":
                self._pos = _skip_space(text, self._pos)
                if text.startswith(self.END, self._pos):
                    self._pos, self._mode = self._pos + len(self.END), "start"
                elif not self.END.startswith(text[self._pos:self._pos + len(self.END)]):
                    self._mode = "broken"
                    return
                else:  # the end tag, or the end of the text, may still come
                    return
            else:
                return


class Llama3JsonToolParser(ToolParser):
    """Llama 3: an optional `<|python_tag|>`, then `{"name": "f", "parameters": {...}}` ("arguments" is also
    taken), or several such objects separated by `;`. A text that does not start with `{` (after the tag and
    whitespace) is content."""

    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        pos = _skip_space(text, 0)
        if text.startswith(self.TAG, pos):
            pos = _skip_space(text, pos + len(self.TAG))
        calls: list[ToolCall] = []
        while True:
            scan = _scan_object(text, pos)
            call = scan and _call_from_scan(text, scan)
            if not call:
                return text, []
            calls.append(call)
            pos = _skip_space(text, scan.end)
            if text.startswith(";", pos):
                pos = _skip_space(text, pos + 1)
            if pos == len(text):
                return None, calls

    def _advance(self, text: str, update: StreamUpdate) -> None:
        while True:
            if self._mode == "start":  # is it calls or content?
                pos = _skip_space(text, 0)
                if text.startswith(self.TAG, pos):
                    pos = _skip_space(text, pos + len(self.TAG))
                elif self.TAG.startswith(text[pos:]):  # the end of the text, or it may become the tag
                    return
                if pos == len(text):
                    return
                self._pos, self._mode = (pos, "open") if text[pos] == "{" else (0, "content")
            elif self._mode == "content":
                self._send_content(update, text[self._pos:])
                self._pos = len(text)
                return
            elif (more := self._object_modes(text, update, then="separator")) is not None:
                if not more:
                    return
            elif self._mode == "separator":
                self._pos = _skip_space(text, self._pos)
                if self._pos == len(text):
                    return
                if text[self._pos] == ";":
                    self._pos += 1
                self._mode = "open"
            else:
                return


class JsonToolParser(ToolParser):
    """A JSON array of `{"name": "f", "parameters": {...}}` objects and nothing else: what structured
    output with required_tools_schema() produces for tool_choice "required"."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, end = self._calls(text)
        return (None, calls) if end is not None and _skip_space(text, end) == len(text) else (text, [])

    @classmethod
    def complete_calls(cls, text: str) -> list[ToolCall]:
        """The whole calls at the start of an array cut short (max_tokens): those before the cut."""
        return cls._calls(text)[0]

    @staticmethod
    def _calls(text: str) -> tuple[list[ToolCall], int | None]:
        """The calls of the array `text` starts with, and where the array ends (None: it does not,
        or an element is not a call; the calls are then those before)."""
        pos = _skip_space(text, 0)
        calls: list[ToolCall] = []
        if not text.startswith("[", pos):
            return calls, None
        while True:
            scan = _scan_object(text, _skip_space(text, pos + 1))
            call = scan and _call_from_scan(text, scan)
            if not call:
                return calls, None
            calls.append(call)
            pos = _skip_space(text, scan.end)
            if text.startswith("]", pos):
                return calls, pos + 1
            if not text.startswith(",", pos):
                return calls, None

    def _advance(self, text: str, update: StreamUpdate) -> None:
        while True:
            if self._mode in ("start", "separator"):
                self._pos = _skip_space(text, self._pos)
                if self._pos == len(text):
                    return
                c = text[self._pos]
                if c == ("[" if self._mode == "start" else ","):
                    self._pos, self._mode = self._pos + 1, "open"
                else:  # "]" ends the array; what follows is for parse() to judge
                    self._mode = "done" if self._mode == "separator" and c == "]" else "broken"
                    return
            elif (more := self._object_modes(text, update, then="separator")) is not None:
                if not more:
                    return
            else:
                return


class MistralToolParser(JsonToolParser):
    """Mistral: `[TOOL_CALLS]` then a JSON array of `{"name": "f", "arguments": {...}}` (tokenizers before
    v11), or then `f[ARGS]{...}` once per call, each after its own `[TOOL_CALLS]` (v11 on). Text before the
    first tag is content. `[TOOL_CALLS]` is a special token, dropped from text that skips special tokens
    (the default): an output that starts with the array is calls too. Streamed: content until the tag;
    an array's calls as they are written (JsonToolParser's reading); the v11 form when it is complete."""

    TAG = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "lead"  # before the first character that says calls or content

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.TAG)
        if at < 0:
            return super().parse(text)
        calls: list[ToolCall] = []
        pos = at
        while text.startswith(self.TAG, pos):
            pos = _skip_space(text, pos + len(self.TAG))
            if text.startswith("[", pos):
                array, end = self._calls(text[pos:])
                if end is None:
                    return text, []
                calls += array
                pos = _skip_space(text, pos + end)
                continue
            args = text.find(self.ARGS, pos)
            name = text[pos:args].strip() if args >= 0 else ""
            scan = _scan_object(text, _skip_space(text, args + len(self.ARGS))) if name else None
            if scan is None or not _is_object(text[scan.start:scan.end]):
                return text, []
            calls.append(ToolCall(new_call_id(), name, text[scan.start:scan.end]))
            pos = _skip_space(text, scan.end)
        if pos != len(text) or not calls:
            return text, []
        return _leftover([text[:at]]), calls

    def _advance(self, text: str, update: StreamUpdate) -> None:
        if self._mode == "lead":
            pos = _skip_space(text, 0)
            if pos == len(text) or (self.TAG.startswith(text[pos:]) and not text.startswith(self.TAG, pos)):
                return  # nothing yet, or the tag's first characters
            # a bare array: the tag was dropped with the special tokens; else content up to the tag
            self._mode = "start" if text.startswith("[", pos) and not text.startswith(self.TAG, pos) else "content"
        if self._mode == "content":
            at = text.find(self.TAG, self._pos)
            if at < 0:
                stop = len(text) - _partial_tag(text, self._pos, self.TAG)
                self._send_content(update, text[self._pos:stop])
                self._pos = stop
                return
            self._send_content(update, text[self._pos:at])
            self._pos = _skip_space(text, at + len(self.TAG))
            if self._pos == len(text):
                self._mode = "tag"
                return
            self._mode = "start" if text[self._pos] == "[" else "held"
        if self._mode == "tag":
            self._pos = _skip_space(text, self._pos)
            if self._pos == len(text):
                return
            self._mode = "start" if text[self._pos] == "[" else "held"
        if self._mode != "held":  # "held": the v11 form, sent by finish() once parse() reads it
            super()._advance(text, update)


class PythonicToolParser(ToolParser):
    """Llama 3.2 / 4's pythonic calls: `[get_weather(city="Paris"), get_time()]`, keyword arguments with
    Python literal values, nothing else in the text (Llama 4's `<|python_start|>` / `<|python_end|>`
    around it are taken). Read with Python's own parser (ast), never evaluated. Streamed: content
    unless the text starts with `[`; calls when the list is complete (finish)."""

    START, END = "<|python_start|>", "<|python_end|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix(self.START).removesuffix(self.END).strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = [self._call(node) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return text, []
        return None, calls

    @staticmethod
    def _call(node: ast.expr) -> ToolCall:
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            raise ValueError("not a call with keyword arguments only")
        name = ast.unparse(node.func)
        if not re.fullmatch(r"[A-Za-z_][\w.\-]*", name):
            raise ValueError("not a function name")
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))

    def _advance(self, text: str, update: StreamUpdate) -> None:
        if self._mode == "start":
            body = text.lstrip()
            if not body or self.START.startswith(body) or body.startswith(self.START):
                return  # may become a call list
            self._mode = "held" if body.startswith("[") else "content"
        if self._mode == "content":
            self._send_content(update, text[self._pos:])
            self._pos = len(text)


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "json": JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}


# -- forced calls: tool_choice "required" or a named function --------------------------------------------
def _parameters(tool: dict) -> dict:
    # a function without parameters still takes an (empty) object
    return tool["function"].get("parameters") or {"type": "object"}


def named_tool_schema(tool: dict) -> dict:
    """The schema of the output for tool_choice naming `tool`: the output is the arguments object."""
    return _parameters(tool)


def required_tools_schema(tools: list[dict], parallel: bool) -> dict:
    """The schema of the output for tool_choice "required": an array of one call (several if `parallel`)
    of any of `tools`, each `{"name": ..., "parameters": {...}}`, as JsonToolParser reads it."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                             "parameters": _parameters(tool)},
              "required": ["name", "parameters"],
              "additionalProperties": False}
             for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def calls_from_required(text: str) -> list[ToolCall]:
    """The calls of an output made with required_tools_schema()."""
    _, calls = JsonToolParser().parse(text)
    if not calls:
        raise ValueError('tool_choice "required": the model\'s output is not a JSON array of {"name": ..., '
                         f'"parameters": {{...}}}} objects: {text[:200]!r}; the output must be generated '
                         "with required_tools_schema() as its structured output")
    return calls


def call_from_named(name: str, text: str) -> ToolCall:
    """The call of an output made with named_tool_schema(): the whole text is the arguments object."""
    arguments = text.strip(_JSON_SPACE)
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"tool_choice names function {name!r}, but the model's output is not JSON ({e}): "
                         f"{arguments[:200]!r}; the output must be generated with named_tool_schema() as "
                         "its structured output") from None
    if not isinstance(value, dict):  # the model's output, not a caller's type error
        message = (f"tool_choice names function {name!r}, but the model's output is a JSON "
                   f"{type(value).__name__}, not the object of the function's arguments: {arguments[:200]!r}")
        raise ValueError(message)  # noqa: TRY004
    return ToolCall(new_call_id(), name, arguments)


class NamedCallStream:
    """Streams the one call of tool_choice naming a function: the whole output is its arguments (leading and
    trailing whitespace left out, as call_from_named does). The first delta carries the id and name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.id = new_call_id()
        self._sent: str | None = None  # None until the first delta

    def stream(self, text: str) -> StreamUpdate:
        # trailing whitespace may be the inside of a string: it is sent once more text follows it
        arguments = text.strip(_JSON_SPACE)
        update = StreamUpdate()
        if self._sent is None:
            update.calls.append(ToolCallDelta(0, self.id, self.name, arguments))
        elif len(arguments) > len(self._sent) and arguments.startswith(self._sent):
            update.calls.append(ToolCallDelta(0, None, None, arguments[len(self._sent):]))
        else:
            return update
        self._sent = arguments
        return update

    def finish(self, text: str) -> StreamUpdate:
        """The last delta; the text is not validated here (call_from_named does)."""
        return self.stream(text)


# -- requests -------------------------------------------------------------------------------------------
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_TOOL_SHAPE = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'
_CHOICES = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


def validate_tools(tools: list[dict] | None, tool_choice: object, parallel_tool_calls: bool | None) -> None:
    """Checks a request's tools, tool_choice and parallel_tool_calls; ValueError says what to change."""
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"tools must be a list of {_TOOL_SHAPE} objects; got {type(tools).__name__}")
    names: dict[str, None] = {}  # in order, and found in O(1)
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f"tools[{i}] must be {_TOOL_SHAPE}: only function tools are supported")
        function = tool.get("function")
        if not isinstance(function, dict):  # a request's value: a client error, not a TypeError
            message = f'tools[{i}].function must be an object with a "name"; got {function!r}'
            raise ValueError(message)  # noqa: TRY004
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise ValueError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-'; "
                             f"got {name!r}")
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} is the name of another tool too; "
                             "give each tool its own name")
        names[name] = None
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ValueError(f"tools[{i}].function.description must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object such as "
                             f'{{"type": "object", "properties": {{...}}}}; got {type(parameters).__name__}')
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls must be true or false; got {parallel_tool_calls!r}")

    if tool_choice is None or tool_choice == "none":
        return
    named = None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        named = (tool_choice.get("function") or {}).get("name")
    if not isinstance(named, str) and tool_choice not in ("auto", "required"):
        raise ValueError(f"tool_choice must be {_CHOICES}; got {tool_choice!r}")
    if not names:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools: send tools, or leave tool_choice out or "
                         'set it to "none"')
    if named is not None and named not in names:
        raise ValueError(f"tool_choice names function {named!r}, which is not one of the tools {list(names)}; "
                         "name one of them")


def find_tool(tools: list[dict], name: str) -> dict:
    """The tool of `tools` (validated) whose function is `name`."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool
    raise ValueError(f"no tool is named {name!r}; the tools are {[t['function']['name'] for t in tools]}")
