"""Engine outputs to the OpenAI objects of one route: /v1/completions or /v1/chat/completions.

The server streams and collects both routes the same way (app.py); all that differs between them is
here, in two small classes: what a finished choice, a streamed choice, a whole response and a stream
chunk look like, and what a stream sends before the first token (chat: the assistant's role;
completions with echo: the prompts).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

from jaxsched.engine.outputs import CompletionOutput
from serving.chat_tools import ChatTools, finish_reason
from serving.convert import Converter
from serving.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from serving.reasoning import ReasoningParser


class Responder(ABC):
    """What one request's response needs besides the outputs, and how it is shaped."""

    prompt_param = "prompt"  # the request field an engine error about the prompt points at
    # the request field the output's grammar came from (response_format, guided_json, tool_choice,
    # ...): what an error of the grammar's during generation names
    grammar_source: str | None = None

    def __init__(self, conv: Converter, rid: str, model: str, req: Any, prompt_lens: list[int],
                 texts: list[str | None]) -> None:
        self.conv, self.rid, self.model, self.req = conv, rid, model, req
        self.created = int(time.time())
        self.prompt_lens, self.texts = prompt_lens, texts
        self.stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())

    def index(self, prompt: int, c: CompletionOutput) -> int:
        """OpenAI's choice index: the n samples of prompt 0, then those of prompt 1, ..."""
        return prompt * self.req.n + c.index

    def usage(self, completion_tokens: int) -> UsageInfo:
        p = sum(self.prompt_lens)
        return UsageInfo(p, completion_tokens, p + completion_tokens)

    @property
    def include_usage(self) -> bool:
        return self.req.stream_options is not None and self.req.stream_options.include_usage

    @abstractmethod
    def choice(self, prompt: int, c: CompletionOutput) -> Any:
        """A finished sample of a whole response."""

    @abstractmethod
    def response(self, choices: list[Any], usage: UsageInfo, prompt_logprobs: list[Any] | None = None) -> Any:
        """The whole response of a request that does not stream; prompt_logprobs: each prompt's
        RequestOutput.prompt_logprobs (None where not asked)."""

    @abstractmethod
    def opening(self) -> list[Any]:
        """The chunks a stream starts with."""

    @abstractmethod
    def delta_choice(self, prompt: int, d: CompletionOutput) -> Any:
        """What is new in one sample, for a stream chunk."""

    @abstractmethod
    def chunk(self, choices: list[Any], usage: UsageInfo | None = None, prompt_logprobs: Any = None) -> Any:
        """One stream chunk (the last one, with the usage, has no choices); prompt_logprobs: its
        prompt's, in the first chunk of that prompt's choices."""


class CompletionResponder(Responder):
    req: CompletionRequest

    def choice(self, prompt: int, c: CompletionOutput) -> CompletionChoice:
        echo = (self.texts[prompt] or "") if self.req.echo else ""
        lp = self.conv.completion_logprobs(c.token_ids, c.logprobs, len(echo)) if c.logprobs else None
        return CompletionChoice(self.index(prompt, c), echo + c.text, lp, c.finish_reason, c.stop_reason)

    def response(self, choices: list[Any], usage: UsageInfo, prompt_logprobs: list[Any] | None = None) -> CompletionResponse:
        if prompt_logprobs is not None and self.req.prompt_logprobs is not None:  # each choice its prompt's
            for c in choices:
                c.prompt_logprobs = self.conv.prompt_logprobs(prompt_logprobs[c.index // self.req.n])
        return CompletionResponse(self.rid, "text_completion", self.created, self.model, choices, usage)

    def opening(self) -> list[CompletionResponse]:
        if not self.req.echo:
            return []
        n = self.req.n
        return [self.chunk([CompletionChoice(i * n + j, text or "", None, None) for j in range(n)])
                for i, text in enumerate(self.texts)]

    def delta_choice(self, prompt: int, d: CompletionOutput) -> CompletionChoice:
        lp = self.conv.completion_logprobs(d.token_ids, d.logprobs, 0) if d.logprobs else None
        return CompletionChoice(self.index(prompt, d), d.text, lp, d.finish_reason, d.stop_reason)

    def chunk(self, choices: list[Any], usage: UsageInfo | None = None, prompt_logprobs: Any = None) -> CompletionResponse:
        if prompt_logprobs is not None:
            choices[0].prompt_logprobs = prompt_logprobs
        return CompletionResponse(self.rid, "text_completion", self.created, self.model, choices, usage)


class ChatResponder(Responder):
    req: ChatCompletionRequest
    prompt_param = "messages"
    tools: ChatTools | None = None  # set when the request has tools (chat_tools.py)
    # set when the server has a --reasoning-parser (reasoning.py); include_reasoning false drops the
    # reasoning it separates from the content
    reasoning: type[ReasoningParser] | None = None
    include_reasoning: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reasoning_streams: dict[int, ReasoningParser] = {}  # choice index -> its reader

    def _logprobs(self, token_ids: list[int], logprobs: Any) -> Any:
        return self.conv.chat_logprobs(token_ids, logprobs, self.req.top_logprobs or 0) if logprobs else None

    def choice(self, prompt: int, c: CompletionOutput) -> ChatChoice:
        reasoning, content = self.reasoning.parse(c.text) if self.reasoning else (None, c.text)
        reasoning = reasoning if self.include_reasoning else None
        message, reason = ChatResponseMessage("assistant", content, reasoning_content=reasoning), c.finish_reason
        if self.tools is not None:
            content, calls = self.tools.parse(content or "")
            if calls:
                message = ChatResponseMessage("assistant", content, self.tools.calls_out(calls), reasoning)
                reason = finish_reason(reason, True)
        return ChatChoice(self.index(prompt, c), message, self._logprobs(c.token_ids, c.logprobs), reason,
                          c.stop_reason)

    def response(self, choices: list[Any], usage: UsageInfo,
                 prompt_logprobs: list[Any] | None = None) -> ChatCompletionResponse:
        pl = self.conv.prompt_logprobs(prompt_logprobs[0]) if prompt_logprobs and self.req.prompt_logprobs is not None \
            else None
        return ChatCompletionResponse(self.rid, "chat.completion", self.created, self.model, choices, usage, pl)

    def opening(self) -> list[ChatCompletionChunk]:
        role = DeltaMessage(role="assistant", content="")
        return [self.chunk([ChatStreamChoice(j, role, None, None) for j in range(self.req.n)])]

    def delta_choice(self, prompt: int, d: CompletionOutput) -> ChatStreamChoice | None:
        index = self.index(prompt, d)
        logprobs = self._logprobs(d.token_ids, d.logprobs)
        finished = d.finish_reason is not None
        reasoning, content = None, d.text
        if self.reasoning is not None:
            reasoning, content = self._reasoning_stream(index, d.text, finished)
        if self.tools is None:
            if reasoning is None and content is None and not finished and logprobs is None and d.text:
                return None  # text held back (a <think> tag may be starting): nothing to send yet
            return ChatStreamChoice(index, DeltaMessage(content=content, reasoning_content=reasoning), logprobs,
                                    d.finish_reason)
        content, calls = self.tools.stream(index, content or "", finished)
        reason = finish_reason(d.finish_reason, self.tools.called(index))
        if content is None and calls is None and reason is None and logprobs is None and reasoning is None:
            return None  # text held back (a tool call may be starting): nothing to send yet
        return ChatStreamChoice(index, DeltaMessage(content=content, tool_calls=calls, reasoning_content=reasoning),
                                logprobs, reason)

    def _reasoning_stream(self, index: int, new_text: str, finished: bool) -> tuple[str | None, str | None]:
        """(new reasoning, new content) of a choice's new text (reasoning None unless included)."""
        parser = self._reasoning_streams.get(index)
        if parser is None:
            parser = self._reasoning_streams[index] = self.reasoning()
        reasoning, content = parser.feed(new_text, finished)
        return (reasoning if self.include_reasoning else None), content

    def chunk(self, choices: list[Any], usage: UsageInfo | None = None, prompt_logprobs: Any = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.rid, "chat.completion.chunk", self.created, self.model, choices, usage,
                                   prompt_logprobs)
