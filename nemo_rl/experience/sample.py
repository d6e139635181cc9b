"""A sealed rollout as training sees it: one entry per model call.

Training uses each model call's own prompt and generated tokens, so tool
outputs (only ever in prompts) are masked by construction and no text is
re-tokenized.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gym_patches.checkpoint.cuts import PrefixContinuation
from gym_patches.checkpoint.replay import ReplayAnnotation


class ModelCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    weight_version: int = 0
    # The call continued a saved generation cut (target_level prefix): its first
    # ``prefix.token_count`` generation tokens (and logprobs) are the cut's.
    prefix: PrefixContinuation | None = None
    # The rollout came back by replay (docs/design.md §4.8): this reply was played back from the record
    # (``replayed``, its tokens, logprobs and weight version the first attempt's), or it is the first live
    # one after the request differed from the record (``divergence`` says where).
    replay: ReplayAnnotation | None = None

    @model_validator(mode="after")
    def _aligned(self) -> "ModelCall":
        if len(self.generation_token_ids) != len(self.generation_log_probs):
            raise ValueError(
                f"generation_token_ids ({len(self.generation_token_ids)}) and "
                f"generation_log_probs ({len(self.generation_log_probs)}) differ in length"
            )
        return self


class RolloutSample(BaseModel):
    """What the data plane stores for a sealed rollout, keyed by ``rollout_id``."""

    model_config = ConfigDict(extra="forbid")

    rollout_id: str  # the Gym capture key of the attempt that sealed
    group_id: str
    generation_index: int = Field(ge=0)
    reward: float
    calls: list[ModelCall] = Field(default_factory=list)
    prompt_id: str = ""
    gym_instance_id: str | None = None  # the Gym replica that ran the attempt (``<shard>/replica-<i>``)
    restored_from: str | None = None  # the boundary a restored attempt continued from (None: from its prompt)
