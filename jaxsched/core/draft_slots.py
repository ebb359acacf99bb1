"""Proposals a draft model makes on the device (speculative_config method "draft_model").

The scheduler sizes a step's proposals before it runs (how many per row, their KV slots, the
step's buckets) but the draft model makes them inside the step (model_runner._draft), from the
tokens the step computes. So the scheduler's proposals are placeholders of the right count; the
runner writes the draft's tokens in their place on the device, and the engine copies them into
the rows (ScheduledRequest.spec_token_ids) before update() compares them with the sampler's draws.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxsched.core.request import Request

PLACEHOLDER = 0  # never read: the draft's token replaces it before the model runs


class DraftSlots:
    """The scheduler's proposer for a draft model (the NgramProposer's interface)."""

    on_device = True  # proposals are known after the step only (the packer cannot use them)

    def propose(self, req: Request, k: int) -> list[int]:
        """k placeholders: a draft model always proposes as many tokens as it is asked for."""
        return [PLACEHOLDER] * max(k, 0)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Nothing is kept per request."""
