"""LLM: offline generation, as vLLM's `LLM(model=...).generate(prompts, sampling_params)`.

A thin loop over an LLMEngine (one core in this process, or data-parallel cores with loops of their
own): validate every prompt first, add them all, step until they finish, return the outputs in input
order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxsched.config import EngineArgs
from jaxsched.core.request import RequestOutputKind, SamplingParams
from jaxsched.engine.frontend import NewRequest
from jaxsched.engine.llm_engine import LLMEngine, PromptType
from jaxsched.engine.outputs import RequestOutput
from jaxsched.engine.tokenizer import chat_prompt_ids


class LLM:
    """Offline generation, as vLLM's `LLM`: `LLM(model=...).generate(prompts, sampling_params)`."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineArgs.from_kwargs(model=model, **kwargs))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts; pass one or "
                                 "one per prompt")
        if priority is None:
            priority = [0] * len(prompts)
        elif len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts; pass one per prompt")
        eng = self.llm_engine
        if not eng.is_leader:
            return self._follow()  # the same script on every host: process 0's prompts are the ones run
        # Only the final outputs are returned, so only they are built (vLLM's LLM does the same): the
        # engine makes no RequestOutput per request per step.
        final: dict[int, SamplingParams] = {}
        for sp in params:
            if id(sp) not in final and (sp is None or isinstance(sp, SamplingParams)):  # else make_request says why
                final[id(sp)] = dataclasses.replace(sp or SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY)
        params = [final.get(id(sp), sp) for sp in params]
        # Validate everything before adding anything: a bad prompt leaves no half-added batch.
        reqs = [eng.make_request(eng.next_request_id(), p, sp, priority=pr)
                for p, sp, pr in zip(prompts, params, priority)]
        for req in reqs:
            eng.add_request_obj(req)
        return self._run(reqs, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        if not messages:
            raise ValueError("messages is empty: pass at least one {'role': ..., 'content': ...}")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = []
        for conv in convs:
            if not conv:
                raise ValueError("messages is empty: pass at least one {'role': ..., 'content': ...}")
            ids = chat_prompt_ids(tok, conv, add_generation_prompt, chat_template, chat_template_kwargs)
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, reqs: list[NewRequest], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        eng = self.llm_engine
        wanted = {r.request_id: i for i, r in enumerate(reqs)}
        results: list[RequestOutput | None] = [None] * len(reqs)
        try:
            with tqdm(total=len(reqs), desc="Processed prompts", disable=not use_tqdm) as bar:
                while eng.has_unfinished_requests():
                    for o in eng.step():
                        if o.finished and o.request_id in wanted:
                            results[wanted[o.request_id]] = o
                            bar.update(1)
        finally:
            eng.end_batch()  # with several hosts the others' generate() returns, even if this one failed
        return [r for r in results if r is not None]

    def _follow(self) -> list[RequestOutput]:
        """generate() on a process other than 0 of a multi-host engine: run process 0's batch step
        for step (distributed.py) and return the same outputs it does."""
        added, outs = self.llm_engine.follow(until="idle")
        done = {o.request_id: o for o in outs if o.finished}
        return [done[rid] for rid in added if rid in done]
