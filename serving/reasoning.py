"""Reasoning models' thinking kept apart from their answer: a chat response's `message.reasoning_content`
and a stream's `delta.reasoning_content`, as vLLM names them, when the server runs with
--reasoning-parser. The answer (the content) is what the tool-call parser then reads.

Two formats, both with `<think>` ... `</think>`:
- "qwen3": the model opens its thinking itself. An output that starts with `<think>` is reasoning up
  to `</think>` and content after it; one that does not (thinking turned off, `enable_thinking`
  false in chat_template_kwargs) is all content.
- "deepseek_r1": the chat template opens `<think>` in the prompt, so the output starts inside the
  reasoning (a `<think>` it repeats is dropped): reasoning up to `</think>`, content after it.
An output cut short before `</think>` (max_tokens, a stop string) is all reasoning, with no content.
Leading whitespace of each part is dropped (the newlines models write after either tag).

One machine reads both the whole text and the stream (feed() with each new piece), so the streamed
pieces always add up to the whole response's parts. Pure Python, no engine.
"""

from __future__ import annotations

START = "<think>"
END = "</think>"


class ReasoningParser:
    """One choice's reader. feed(new text) -> (new reasoning, new content), each None when empty;
    held back: the start of what may be a tag, and a part's leading whitespace."""

    opens_in_reasoning = False  # deepseek_r1: the prompt opened the thinking

    def __init__(self) -> None:
        self._held = ""  # text read but not settled: at most a tag's start (or leading whitespace)
        self._mode = "start"  # "start" (before the first tag is settled), "reasoning" or "content"
        self._begun = {"reasoning": False, "content": False}  # a part's first non-space character was sent

    @classmethod
    def parse(cls, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output."""
        return cls().feed(text, finished=True)

    def feed(self, new_text: str, finished: bool = False) -> tuple[str | None, str | None]:
        """What `new_text` (the output's next piece) adds; finished: it is the last one."""
        text, out = self._held + new_text, {"reasoning": "", "content": ""}
        if self._mode == "start":
            rest = text.lstrip()
            if START.startswith(rest) and rest != START and not finished:
                self._held = text
                return None, None  # "<thi": a tag may be coming
            if rest.startswith(START):
                text = rest[len(START):]
                self._mode = "reasoning"
            else:
                self._mode = "reasoning" if self.opens_in_reasoning else "content"
        if self._mode == "reasoning":
            at = text.find(END)
            if at < 0:
                stop = len(text) if finished else len(text) - _partial(text, END)
                self._send(out, "reasoning", text[:stop])
                text = text[stop:]
            else:
                self._send(out, "reasoning", text[:at])
                text, self._mode = text[at + len(END):], "content"
        if self._mode == "content":
            self._send(out, "content", text)
            text = ""
        self._held = text
        return out["reasoning"] or None, out["content"] or None

    def _send(self, out: dict[str, str], part: str, piece: str) -> None:
        if not self._begun[part]:
            piece = piece.lstrip()
            self._begun[part] = bool(piece)
        out[part] += piece


class DeepSeekR1ReasoningParser(ReasoningParser):
    opens_in_reasoning = True


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": ReasoningParser,
}


def reasoning_parser(name: str | None) -> type[ReasoningParser] | None:
    """The parser class named by --reasoning-parser (None: none); ValueError listing the known ones."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown --reasoning-parser {name!r}: one of {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]
