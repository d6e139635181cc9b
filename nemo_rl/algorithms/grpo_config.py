"""Typed config sections for GRPO training (``grpo``, ``loss_fn``, ``policy``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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


class LossConfig(_Section):
    ratio_clip_min: float = Field(default=0.2, ge=0.0)
    ratio_clip_max: float = Field(default=0.2, ge=0.0)
    reference_policy_kl_penalty: float = Field(default=0.0, ge=0.0)


class GenerationConfig(_Section):
    backend: Literal["torch", "vllm"] = "torch"
    temperature: float = Field(default=1.0, gt=0.0)
    max_new_tokens: int = Field(default=96, ge=1)
    # Requests that arrive within this window are decoded as one batch.
    batch_window_ms: float = Field(default=2.0, ge=0.0)
    max_batch_size: int = Field(default=64, ge=1)


class WarmStartConfig(_Section):
    """Supervised warm start on the rows' demonstrations (see ``warm_start.py``).

    Defaults were tuned with ``local_learning_check``: on the workplace rows
    they leave ~15-30% success at temperature 1 (greedy 80-100%), which GRPO
    lifts by 0.3-0.5 within 30 steps of 8x8 rollouts.
    """

    steps: int = Field(default=800, ge=0)
    batch_size: int = Field(default=16, ge=1)
    learning_rate: float = Field(default=5e-3, gt=0.0)
    # Mass kept off the demonstrated tokens: exploration that RL then sharpens.
    label_smoothing: float = Field(default=0.025, ge=0.0, lt=1.0)


class PolicyConfig(_Section):
    model_name: str = "tiny-causal-lm"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    learning_rate: float = Field(default=3e-4, gt=0.0)
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    # Architecture of the tiny causal transformer (vocab size comes from the tokenizer).
    hidden_size: int = Field(default=128, ge=8)
    num_layers: int = Field(default=2, ge=1)
    num_heads: int = Field(default=4, ge=1)
    mlp_ratio: int = Field(default=4, ge=1)
    max_seq_len: int = Field(default=1024, ge=8)
    init_seed: int = 0
    # Optimizer / batching for training.
    weight_decay: float = Field(default=0.0, ge=0.0)
    adam_betas: tuple[float, float] = (0.9, 0.99)
    train_micro_batch_size: int = Field(default=16, ge=1)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)

    @model_validator(mode="after")
    def _heads_divide(self) -> "PolicyConfig":
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"policy.hidden_size ({self.hidden_size}) must split into num_heads "
                f"({self.num_heads}) heads of even size"
            )
        return self
