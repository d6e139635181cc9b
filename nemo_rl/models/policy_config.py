"""Typed config of the policy section (``policy``: the model, its generation backend, the embedded default's
recipe and warm start), for the model layer that reads it; the whole schema re-exports it
(``nemo_rl.algorithms.grpo_config``, ``single_controller_utils/config.py``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VllmConfig(_Section):
    """``policy.generation.vllm_cfg``: the vLLM backend (``policy.generation.backend: vllm``).

    Names follow upstream NeMo-RL where they exist. The backend always runs
    vLLM's async engine behind vLLM's own OpenAI-compatible server, so
    ``async_engine`` and ``expose_http_server`` must stay true.
    """

    async_engine: bool = True
    expose_http_server: bool = True
    # Options of vLLM's chat serving: automatic tool choice with the hermes tool parser.
    http_server_serving_chat_kwargs: dict[str, Any] = Field(
        default_factory=lambda: {"enable_auto_tools": True, "tool_parser": "hermes"})
    # On CPU this is the share of host memory vLLM reserves for its KV cache.
    gpu_memory_utilization: float = Field(default=0.1, gt=0.0, le=1.0)
    # None: policy.max_seq_len.
    max_model_len: int | None = Field(default=None, ge=8)
    max_num_seqs: int = Field(default=64, ge=1)
    enforce_eager: bool = True
    tensor_parallel_size: int = Field(default=1, ge=1)
    # Seconds to wait for the server's first /health before failing setup.
    startup_timeout_s: float = Field(default=600.0, gt=0.0)

    @model_validator(mode="after")
    def _served(self) -> "VllmConfig":
        if not self.async_engine or not self.expose_http_server:
            raise ValueError(
                "policy.generation.vllm_cfg: async_engine and expose_http_server must be true (Gym's model "
                "server talks to vLLM's OpenAI-compatible HTTP server, which runs on the async engine)")
        unknown = set(self.http_server_serving_chat_kwargs) - {"enable_auto_tools", "tool_parser"}
        if unknown:
            raise ValueError(
                f"policy.generation.vllm_cfg.http_server_serving_chat_kwargs: unsupported keys {sorted(unknown)} "
                "(supported: enable_auto_tools, tool_parser)")
        return self


class GenerationConfig(_Section):
    backend: Literal["torch", "vllm"] = "torch"
    vllm_cfg: VllmConfig = Field(default_factory=VllmConfig)
    temperature: float = Field(default=1.0, gt=0.0)
    max_new_tokens: int = Field(default=96, ge=1)
    # Requests that arrive within this window are decoded as one batch.
    batch_window_ms: float = Field(default=2.0, ge=0.0)
    max_batch_size: int = Field(default=64, ge=1)
    # vLLM's ignore_eos for every call: decode to max_new_tokens (long generations for benchmarks and
    # tests of generation cuts); a request's own ``ignore_eos`` also turns it on.
    ignore_eos: bool = False


class WarmStartConfig(_Section):
    """Supervised warm start of the embedded tiny model on the rows' demonstrations.

    Part of the embedded default's recipe (``policy.model_name: tiny-causal-lm``):
    its result is cached and is that model's "pretrained" weights. A model
    given by hub id or directory is used as given (no warm start).
    """

    steps: int = Field(default=800, ge=0)
    batch_size: int = Field(default=16, ge=1)
    learning_rate: float = Field(default=5e-3, gt=0.0)
    # Mass kept off the demonstrated tokens: exploration that RL then sharpens.
    label_smoothing: float = Field(default=0.025, ge=0.0, lt=1.0)


class TinyModelRecipe(_Section):
    """How the embedded default model is made: a tokenizer trained with ``tokenizers``
    on the task data and a randomly initialised model of a real architecture.

    Everything here (with the training rows) keys its cache directory.
    """

    architecture: Literal["qwen3", "qwen2"] = "qwen3"
    vocab_size: int = Field(default=2000, ge=300)
    hidden_size: int = Field(default=128, ge=32)
    intermediate_size: int = Field(default=512, ge=8)
    num_layers: int = Field(default=2, ge=1)
    num_heads: int = Field(default=4, ge=1)
    num_kv_heads: int = Field(default=4, ge=1)
    # vLLM's CPU attention needs head_dim >= 32.
    head_dim: int = Field(default=32, ge=32)
    max_position_embeddings: int = Field(default=1024, ge=64)
    init_seed: int = 0

    @model_validator(mode="after")
    def _heads(self) -> "TinyModelRecipe":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"policy.tiny_model.num_heads ({self.num_heads}) must be a multiple of "
                f"policy.tiny_model.num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"policy.tiny_model.head_dim ({self.head_dim}) must be even (rotary positions)")
        return self


EMBEDDED_MODEL_NAME = "tiny-causal-lm"


class PolicyConfig(_Section):
    # A Hugging Face hub id, a local model directory, or the embedded default (built locally).
    model_name: str = EMBEDDED_MODEL_NAME
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    learning_rate: float = Field(default=3e-4, gt=0.0)
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    # Longest prompt + reply (also capped by the model's max_position_embeddings).
    max_seq_len: int = Field(default=1024, ge=8)
    # Where the embedded model (tokenizer, init, warm start) is cached; None: $NEMO_RL_MODEL_CACHE
    # or ~/.cache/nemo_rl/models.
    cache_dir: str | None = None
    tiny_model: TinyModelRecipe = Field(default_factory=TinyModelRecipe)
    # Optimizer / batching for training.
    weight_decay: float = Field(default=0.0, ge=0.0)
    adam_betas: tuple[float, float] = (0.9, 0.99)
    train_micro_batch_size: int = Field(default=16, ge=1)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)

    @property
    def is_embedded(self) -> bool:
        return self.model_name == EMBEDDED_MODEL_NAME
