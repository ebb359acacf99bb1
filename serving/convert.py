"""OpenAI requests to engine inputs, engine outputs to OpenAI responses: the server's pure functions.

Prompts are tokenized and chat templates rendered on a TokenizerPool's threads; outputs are turned
into OpenAI's shapes on the event loop with the server's own copy of the tokenizer (the engine thread
decodes with the engine's: a fast tokenizer shared across threads can fail with "Already borrowed").
Errors are RequestErrors naming the parameter to change.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from typing import Any

import msgspec

from jaxsched.core.limits import MAX_ALLOWED_TOKEN_IDS_TOTAL, MAX_DETOKENIZE_IDS, MAX_N, MAX_SEQUENCES
from jaxsched.core.request import RequestOutputKind, SamplingParams, short_repr
from jaxsched.engine.frontend import first_bad_token_id
from jaxsched.engine.gguf_tokenizer import byte_alphabet
from jaxsched.engine.outputs import Logprob
from jaxsched.engine.tokenizer import PromptTooLongError, chat_prompt_ids, max_token_chars
from jaxsched.errors import InvalidRequestError
from jaxsched.structured.params import StructuredOutputsParams, from_response_format
from serving.chat_tools import as_text_call, template_takes_tools, tool_prompt
from serving.protocol import (
    ChatCompletionRequest,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatMessage,
    CompletionLogprobs,
    CompletionRequest,
    PromptLogprob,
    PromptLogprobs,
    RequestError,
    TopLogprob,
)
from serving.tokenizer_pool import TokenizerPool

logger = logging.getLogger(__name__)


# GPT-2's byte-level BPE alphabet (Llama 3, Qwen, SmolLM...): character -> the byte it stands for
_BYTE_LEVEL = {c: b for b, c in byte_alphabet().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


# OpenAI's chat roles; anything else is refused rather than rendered into the prompt
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# apply_chat_template's own arguments: chat_template_kwargs only sets template variables
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding",
    "truncation", "max_length"})


class Converter:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, max_logprobs: int,
                 trust_request_chat_template: bool = False, tokenizer_workers: int = 2) -> None:
        try:
            self.tokenizer = copy.deepcopy(tokenizer)  # the event loop's own, for outputs
        except Exception:  # noqa: BLE001 - one that cannot be copied is shared; it is only read here
            self.tokenizer = tokenizer
        self.pool = TokenizerPool(tokenizer, tokenizer_workers)  # prompts of generation requests
        # /tokenize and /detokenize take any length (counting tokens is their purpose): a thread of
        # their own, so that they can never hold up the prompts of generation requests
        self.utility_pool = TokenizerPool(tokenizer, 1, name="tokenize-route")
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.trust_request_chat_template = trust_request_chat_template
        # Longer texts cannot fit max_model_len (see max_token_chars); twice the bound, so that a
        # normalizer that drops characters never gets a prompt that fits refused.
        self.max_prompt_chars = 2 * max_model_len * max_token_chars(tokenizer)
        self._token_text: dict[int, str] = {}

    # -- prompts (tokenized on the pool's threads) ------------------------------------------------
    def _check_count(self, ids: list[Any], param: str, limit: int) -> None:
        """The O(1) check before any work over `ids`."""
        if not ids:
            raise RequestError(f"{param} is empty: pass at least one token", param=param)
        if len(ids) > limit and param == "prompt":
            raise RequestError(f"the prompt is {len(ids)} tokens but max_model_len is {limit}: shorten the prompt to "
                               "fewer tokens than max_model_len", param=param, code="context_length_exceeded")
        if len(ids) > limit:
            raise RequestError(f"{param} has {len(ids)} token ids, more than the {limit} one request may carry: send "
                               "fewer", param=param)

    def _check_ids(self, ids: list[Any], param: str) -> list[int]:
        """Every id an int of the vocabulary (a loop over them: on a worker thread, after
        _check_count; the engine then takes them unchecked, as CheckedTokens)."""
        if (bad := first_bad_token_id(ids, self.vocab_size)) >= 0:
            raise RequestError(f"token ids must be integers in [0, {self.vocab_size}), got {short_repr(ids[bad])}",
                               param=param)
        return ids

    def _check_length(self, text: str, param: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise RequestError(f"the {param} is {len(text)} characters, more than any prompt that fits "
                               f"max_model_len ({self.max_model_len} tokens): shorten it", param=param,
                               code="context_length_exceeded")

    async def tokenize(self, text: str, param: str = "prompt", add_special_tokens: bool = True,
                       limit: bool = True) -> list[int]:
        """Token ids of `text` (limit: refuse, untokenized, a text too long for max_model_len)."""
        if limit:
            self._check_length(text, param)
        try:
            ids = await (self.pool if limit else self.utility_pool).run(
                lambda tok, text: self._checked_encoding(tok, text, add_special_tokens, param), text)
        except RequestError:
            raise
        except Exception as e:
            raise RequestError(f"could not tokenize the {param}: {e}", param=param) from e
        return ids

    def _checked_encoding(self, tokenizer: Any, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """On a worker thread: the ids of `text`, checked against the model's vocabulary (a tokenizer
        may have more tokens than the model has rows)."""
        return self._check_ids(_encode(tokenizer, text, add_special_tokens), param)

    async def detokenize(self, ids: list[int], param: str = "tokens") -> str:
        self._check_count(ids, param, MAX_DETOKENIZE_IDS)
        return await self.utility_pool.run(lambda tok, ids: tok.decode(self._check_ids(ids, param)), ids)

    async def _checked_prompts(self, prompts: list[list[Any]]) -> list[tuple[list[int], None]]:
        """Token-id prompts, counted here and checked id by id on a worker thread (a request may
        carry millions of ids: the event loop must not walk them)."""
        for p in prompts:
            self._check_count(p, "prompt", self.max_model_len)
        return await self.pool.run(lambda tok, ps: [(self._check_ids(p, "prompt"), None) for p in ps], prompts)

    @staticmethod
    def check_allowed_total(req: CompletionRequest | ChatCompletionRequest, num_prompts: int) -> None:
        """Every sequence carries the request's allowed_token_ids to the engine: a bound on their sum,
        checked before anything walks the list."""
        allowed, n = req.allowed_token_ids, min(req.n, MAX_N) if isinstance(req.n, int) and req.n > 0 else 1
        if allowed and len(allowed) * num_prompts * n > MAX_ALLOWED_TOKEN_IDS_TOTAL:
            raise RequestError(f"allowed_token_ids ({len(allowed)} ids) x {num_prompts} prompts x n = {n} is more "
                               f"than {MAX_ALLOWED_TOKEN_IDS_TOTAL} ids in one request: send fewer prompts per "
                               "request", param="allowed_token_ids")

    @staticmethod
    def check_sequences(num_prompts: int, n: int) -> None:
        """One request may queue at most MAX_SEQUENCES sequences (prompts x samples) at once."""
        if num_prompts * n > MAX_SEQUENCES:
            raise RequestError(f"{num_prompts} prompts x n = {n} samples is more than the {MAX_SEQUENCES} sequences "
                               "one request may ask for: split it into several requests",
                               param="prompt" if n == 1 else "n")

    async def completion_prompts(self, prompt: Any, add_special_tokens: bool = True) -> list[tuple[list[int], str | None]]:
        """(token ids, text) of each prompt of a /v1/completions request."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) and not isinstance(prompt[0], bool):
            return await self._checked_prompts([prompt])  # one prompt of token ids
        if isinstance(prompt, list) and prompt:
            self.check_sequences(len(prompt), 1)  # before tokenizing any of them
            if all(isinstance(p, str) for p in prompt):
                for p in prompt:
                    self._check_length(p, "prompt")
                return [(await self._nonempty(p, add_special_tokens), p) for p in prompt]
            if all(isinstance(p, list) for p in prompt):
                return await self._checked_prompts(prompt)
        raise RequestError("prompt must be a non-empty string, a list of strings, a list of token ids or a list "
                           "of token-id lists", param="prompt")

    async def _nonempty(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = await self.tokenize(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise RequestError("prompt is empty: pass at least one character", param="prompt")
        return ids

    @staticmethod
    def conversation(messages: list[ChatMessage], tools_as_text: bool = False) -> list[dict[str, Any]]:
        """The messages as the chat template takes them. An assistant's tool calls go in with their
        arguments as objects (what templates that take tools expect; vLLM does the same), or, with
        tools_as_text (a template that knows no tools), as the <tool_call> text they came from."""
        if not messages:
            raise RequestError("messages is empty: pass at least one {'role': ..., 'content': ...}",
                               param="messages")
        conv = []
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise RequestError(f"messages[{i}].role is {short_repr(m.role)}; the allowed roles are "
                                   f"{', '.join(CHAT_ROLES)}", param="messages", code="invalid_value")
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise RequestError(f"only content parts of type 'text' (with a 'text' field) are supported, "
                                           f"got type {short_repr(part.type)}", param="messages")
                    texts.append(part.text)
                content = "\n".join(texts)
            msg: dict[str, Any] = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                calls = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                                   "arguments": _arguments(c.function.arguments, i)}}
                         for c in m.tool_calls]
                if tools_as_text:
                    msg["content"] = "\n".join([msg["content"], *map(as_text_call, calls)]).strip()
                else:
                    msg["tool_calls"] = calls
            conv.append(msg)
        return conv

    def template_args(self, chat_template: str | None, kwargs: dict[str, Any] | None) -> tuple[str | None,
                                                                                             dict[str, Any]]:
        """(request-supplied template, template variables), refusing a request's own template unless
        the server trusts them (a template is code: vLLM's CVE-2025-61620)."""
        kwargs = dict(kwargs or {})
        if "chat_template" in kwargs:
            if chat_template is not None:
                raise RequestError("pass the chat template once: chat_template or chat_template_kwargs.chat_template",
                                   param="chat_template")
            chat_template = kwargs.pop("chat_template")
        if chat_template is not None:
            if not self.trust_request_chat_template:
                raise RequestError("this server does not accept chat templates from requests (a template is code it "
                                   "would run); start it with --trust-request-chat-template to allow them",
                                   param="chat_template", code="chat_template_not_allowed")
            if not isinstance(chat_template, str):
                raise RequestError("chat_template must be a string", param="chat_template")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise RequestError(f"chat_template_kwargs cannot set {', '.join(reserved)} (they are not template "
                               "variables)", param="chat_template_kwargs")
        return chat_template, kwargs

    async def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          kwargs: dict[str, Any] | None = None, chat_template: str | None = None,
                          limit: bool = True, tools: list[dict[str, Any]] | None = None, tool_parser: str = "hermes",
                          continue_final_message: bool = False, add_special_tokens: bool = False) -> list[int]:
        """The chat's prompt ids. `tools` go to the template, or, when the template never reads
        them, into a system message in `tool_parser`'s format (chat_tools.tool_prompt)."""
        template, variables = self.template_args(chat_template, kwargs)
        as_text = bool(tools) and not template_takes_tools(template or self.tokenizer.chat_template)
        conv = self.conversation(messages, tools_as_text=as_text)
        if as_text:
            prompt = tool_prompt(tools, tool_parser)
            if conv[0]["role"] in ("system", "developer"):
                conv[0] = {**conv[0], "content": f"{conv[0]['content']}\n\n{prompt}".strip()}
            else:
                conv.insert(0, {"role": "system", "content": prompt})
            tools = None
        if continue_final_message:
            if add_generation_prompt:
                raise RequestError("continue_final_message and add_generation_prompt cannot both be true: set "
                                   "add_generation_prompt to false to continue the last message",
                                   param="continue_final_message")
            if conv[-1]["role"] != "assistant":
                raise RequestError("continue_final_message needs the last message to be the assistant's",
                                   param="continue_final_message")
        for i, m in enumerate(conv):
            if limit:
                self._check_length(m["content"], f"messages[{i}].content")
        def render(tok: Any) -> list[int]:  # on a worker thread, the ids checked there too
            try:
                ids = chat_prompt_ids(tok, conv, add_generation_prompt, template, variables,
                                      self.max_prompt_chars if limit else None, tools, continue_final_message,
                                      add_special_tokens)
            except PromptTooLongError as e:
                raise RequestError(f"{e}: shorten the messages", param="messages",
                                   code="context_length_exceeded") from e
            except Exception as e:
                raise RequestError(f"could not apply the chat template: {e}", param="messages") from e
            return self._check_ids(ids, "messages")

        return await (self.pool if limit else self.utility_pool).run(render)

    # -- sampling parameters -------------------------------------------------------------------
    @staticmethod
    def structured_outputs(req: CompletionRequest | ChatCompletionRequest,
                           forced: StructuredOutputsParams | None = None
                           ) -> tuple[StructuredOutputsParams | None, str | None]:
        """What the request's output must match, and the field that asked for it (what a compile
        error names): response_format, structured_outputs, vLLM's older guided_* fields, or `forced`
        (tool_choice "required" or named: its schema comes from `tools`). More than one is a 400."""
        given: list[tuple[str, StructuredOutputsParams]] = []
        try:
            rf = req.response_format
            if rf is not None:
                so = from_response_format(msgspec.to_builtins(rf))
                if so is not None:
                    given.append(("response_format", so))
            if req.structured_outputs is not None:
                kw = {k: v for k, v in msgspec.structs.asdict(req.structured_outputs).items()
                      if v is not None and k != "structural_tag"}
                given.append(("structured_outputs", StructuredOutputsParams(**kw)))
            guided = {k: getattr(req, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")
                      if getattr(req, f"guided_{k}") is not None}
            if guided:
                given.append((f"guided_{next(iter(guided))}",
                              StructuredOutputsParams(**guided, whitespace_pattern=req.guided_whitespace_pattern)))
        except InvalidRequestError as e:
            raise RequestError(str(e), param=e.param) from e
        if forced is not None:
            given.append(("tool_choice", forced))
        if len(given) > 1:
            names = ", ".join(n for n, _ in given)
            raise RequestError(f"the output can follow one constraint only, got {names}: pass one of them",
                               param=given[1][0])
        if not given:
            return None, None
        name, so = given[0]
        return so, "tools" if name == "tool_choice" else name

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest, prompt_lens: list[int],
                        max_tokens: int | None, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None) -> list[SamplingParams]:
        """The SamplingParams of each prompt (of these lengths). They differ only in max_tokens: the
        rest is built and checked once."""
        limits = [self._max_tokens(req, n, max_tokens) for n in prompt_lens]
        self.check_allowed_total(req, len(prompt_lens))
        first = self._sampling_params(req, limits[0], logprobs, structured_outputs)
        self.check_sequences(len(prompt_lens), first.n)
        try:
            return [first.with_max_tokens(m) for m in limits]
        except InvalidRequestError as e:
            raise RequestError(str(e), param=e.param) from e

    def _max_tokens(self, req: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                    max_tokens: int | None) -> int | None:
        """A prompt's max_tokens, checked against max_model_len."""
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if prompt_len >= self.max_model_len:
            raise RequestError(f"the prompt is {prompt_len} tokens but max_model_len is {self.max_model_len}: "
                               "shorten the prompt to fewer tokens than max_model_len", param=param,
                               code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = self.max_model_len - prompt_len
        elif isinstance(max_tokens, int) and prompt_len + max_tokens > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the {param}, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or max_tokens.", param="max_tokens",
                code="context_length_exceeded")
        return max_tokens

    def _sampling_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                         logprobs: int | None, structured_outputs: StructuredOutputsParams | None) -> SamplingParams:
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        bias = None
        if req.logit_bias:
            try:  # int() alone would also take "1_0", " 5 " and other digits than 0-9
                if not all(k.isascii() and k.isdigit() for k in req.logit_bias):
                    raise ValueError
                bias = {int(k): v for k, v in req.logit_bias.items()}
            except ValueError:
                raise RequestError("logit_bias keys must be token ids written as strings of digits, e.g. "
                                   '{"1234": -100}', param="logit_bias") from None
        if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= self.max_logprobs:
            raise RequestError(f"prompt_logprobs must be between 0 and {self.max_logprobs} (the server's "
                               f"max_logprobs), got {req.prompt_logprobs}", param="prompt_logprobs")
        if logprobs is not None and not 0 <= logprobs <= self.max_logprobs:
            raise RequestError(f"logprobs must be between 0 and {self.max_logprobs} (the server's max_logprobs), "
                               f"got {logprobs}", param="top_logprobs" if param == "messages" else "logprobs")
        kw = {
            "n": req.n, "max_tokens": max_tokens, "stop": req.stop, "seed": req.seed, "logprobs": logprobs,
            "prompt_logprobs": req.prompt_logprobs,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "top_k": 0 if req.top_k is None else req.top_k,
            "min_p": 0.0 if req.min_p is None else req.min_p,
            "presence_penalty": req.presence_penalty or 0.0,
            "frequency_penalty": req.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
            "min_tokens": req.min_tokens, "ignore_eos": req.ignore_eos, "stop_token_ids": req.stop_token_ids,
            "skip_special_tokens": req.skip_special_tokens,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "logit_bias": bias, "allowed_token_ids": req.allowed_token_ids, "structured_outputs": structured_outputs,
            # a stream sends what is new; a response needs the final output alone
            "output_kind": RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
        }
        try:
            return SamplingParams(**kw)
        except InvalidRequestError as e:  # its param is a SamplingParams field, named as the request's
            raise RequestError(str(e), param=e.param) from e

    # -- outputs -------------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a piece of a UTF-8 character for some)."""
        raw = self.tokenizer.convert_ids_to_tokens(token_id) or ""
        m = _BYTE_FALLBACK.fullmatch(raw)
        if m:
            return bytes([int(m.group(1), 16)])
        if raw and all(c in _BYTE_LEVEL for c in raw):
            return bytes(_BYTE_LEVEL[c] for c in raw)
        return self.tokenizer.decode([token_id]).encode()

    def token_text(self, token_id: int) -> str:
        """A token as text; a token that is not whole UTF-8 is spelled "bytes:\\xe4\\xbd" as OpenAI does,
        so distinct tokens keep distinct keys in top_logprobs."""
        s = self._token_text.get(token_id)
        if s is None:
            b = self.token_bytes(token_id)
            try:
                s = b.decode("utf-8")
            except UnicodeDecodeError:
                s = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            self._token_text[token_id] = s
        return s

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]],
                            offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for t, entry in zip(token_ids, logprobs):
            s = self.token_text(t)
            out.tokens.append(s)
            out.token_logprobs.append(entry[t].logprob if t in entry else None)
            top: dict[str, float] = {}
            for k, v in entry.items():  # two ids may still spell the same text: keep the likelier
                key = self.token_text(k)
                top[key] = max(v.logprob, top.get(key, -float("inf")))
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(s)
        return out

    @staticmethod
    def prompt_logprobs(entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
        """A RequestOutput's prompt_logprobs as vLLM's responses carry them."""
        if entries is None:
            return None
        return [None if e is None else {t: PromptLogprob(lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()}
                for e in entries]

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top: int) -> ChatLogprobs:
        content = []
        for t, entry in zip(token_ids, logprobs):
            s = self.token_text(t)
            ranked = sorted((lp.rank or 0, k, lp) for k, lp in entry.items() if lp.rank is not None and lp.rank <= top)
            alts = [TopLogprob(self.token_text(k), lp.logprob, list(self.token_bytes(k))) for _, k, lp in ranked]
            lp = entry[t].logprob if t in entry else float("nan")
            content.append(ChatLogprobEntry(s, lp, list(self.token_bytes(t)), alts))
        return ChatLogprobs(content=content)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    # tokenizer(...) rather than .backend_tokenizer.encode: it encodes as a batch, which releases the GIL
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _arguments(text: str, i: int) -> Any:
    """A tool call's arguments (JSON text, as OpenAI sends them) as an object for the template."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's parser goes
        raise RequestError(f"messages[{i}].tool_calls has arguments that are not valid JSON (or nested too deeply): "
                           "send the JSON text the call was made with", param="messages") from None
