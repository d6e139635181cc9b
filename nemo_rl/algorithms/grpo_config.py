"""Typed config sections for GRPO training (``grpo``, ``loss_fn``, ``policy``; the policy's own sections live
with the model layer that reads them, ``nemo_rl.models.policy_config``, and are re-exported here)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from nemo_rl.models.policy_config import (  # noqa: F401 - re-exported: the schema's home stays here
    EMBEDDED_MODEL_NAME,
    GenerationConfig,
    PolicyConfig,
    TinyModelRecipe,
    VllmConfig,
    WarmStartConfig,
)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GRPOConfig(_Section):
    num_prompts_per_step: int = Field(default=4, ge=1)
    num_generations_per_prompt: int = Field(default=4, ge=1)
    max_num_steps: int = Field(default=20, ge=1)
    seed: int = 42
    normalize_rewards: bool = True
    # Use the logprobs the generation worker returned as the PPO "old" logprobs
    # instead of recomputing them with the trainer's weights before the update.
    use_generation_logprobs: bool = False
    # Validation on data.val_data_path: one rollout per row (the first max_val_samples rows)
    # every val_period steps (0: never) and, if val_at_start, before the first step.
    val_period: int = Field(default=0, ge=0)
    val_at_start: bool = False
    max_val_samples: int = Field(default=16, ge=1)
    # Deterministic mode: every model call's tokens depend only on its request and a seed from ``seed``, its
    # rollout (prompt position, sibling) and its index in the rollout, never on timing, batching, restarts or
    # attempts; the trainer takes each step's samples in one canonical order; each step's trained samples are
    # written to <logger.log_dir>/trained/. What recovery parity (examples/recovery_parity.py) needs. Its cost:
    # the generation worker decodes one call at a time (no batching) and loads new weights only between calls
    # (see docs/benchmarks.md for steps per hour on and off). Refused with streaming train.
    deterministic: bool = False


class LossConfig(_Section):
    ratio_clip_min: float = Field(default=0.2, ge=0.0)
    ratio_clip_max: float = Field(default=0.2, ge=0.0)
    reference_policy_kl_penalty: float = Field(default=0.0, ge=0.0)
