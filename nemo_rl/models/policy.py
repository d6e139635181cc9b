"""A tiny autoregressive causal transformer used as the GRPO policy.

Why so small: the whole RL loop (generation, Gym rollouts, training) must run
on two CPU cores in minutes, and the same code must run on CUDA. Pre-norm
blocks, rotary positions (no hard length limit in the math; ``max_seq_len``
is a guard), tied embeddings, and a per-layer KV cache so decoding is
incremental. ``sample_batch`` decodes left-padded prompts together, which is
what lets one generation worker serve many concurrent rollouts cheaply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nemo_rl.algorithms.grpo_config import PolicyConfig


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; asking for cuda without it is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("policy.device is 'cuda' but CUDA is not available")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"policy.device must be auto, cpu or cuda, got {device!r}")
    return torch.device(device)


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate pairs of channels of ``x`` [B, H, T, D] by angles set by ``positions`` [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[:, None, :, None] * inv  # B,1,T,D/2
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, mlp_ratio * d), nn.GELU(), nn.Linear(mlp_ratio * d, d))

    def forward(self, x, positions, mask, cache):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        q, k = _rope(q, positions), _rope(k, positions)
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        if mask is None:  # no cache, no padding: plain causal
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        x = x + self.mlp(self.ln2(x))
        return x, (k, v)


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (stop token emitted) or "length"


class CausalTransformerPolicy(nn.Module):
    """``forward(ids) -> logits``; ``sample``/``sample_batch`` decode; ``token_logprobs`` rescores."""

    def __init__(self, cfg: PolicyConfig, vocab_size: int):
        super().__init__()
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.max_seq_len = cfg.max_seq_len
        g = torch.Generator().manual_seed(cfg.init_seed)
        self.embed = nn.Embedding(vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg.hidden_size, cfg.num_heads, cfg.mlp_ratio) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self._init_weights(g)

    def _init_weights(self, g: torch.Generator) -> None:
        std = 0.02
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    s = std / math.sqrt(2 * len(self.blocks)) if name.endswith(("proj.weight", "mlp.2.weight")) else std
                    p.copy_(torch.randn(p.shape, generator=g) * s)
                elif name.endswith("bias"):
                    p.zero_()

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    # ----- core ----------------------------------------------------------
    def forward(self, ids: torch.Tensor, positions=None, mask=None, cache=None, return_cache: bool = False):
        """ids [B, T] -> logits [B, T, V]. ``mask`` is a bool attention mask [B, 1, T, S] (True = attend)."""
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        x = self.embed(ids)
        new_cache = []
        for i, blk in enumerate(self.blocks):
            x, kv = blk(x, positions, mask, None if cache is None else cache[i])
            new_cache.append(kv)
        logits = F.linear(self.ln_f(x), self.embed.weight)
        return (logits, new_cache) if return_cache else logits

    def sequence_logprobs(self, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Right-padded ids [B, T] -> logprob of ids[:, 1:] given the prefix, [B, T-1]."""
        logits = self.forward(ids)[:, :-1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)

    @torch.no_grad()
    def token_logprobs(self, prompt_ids: list[int], gen_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        """Logprob of each generated token (under ``logits / temperature``), shape [len(gen_ids)]."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if not gen_ids:
            return torch.zeros(0)
        ids = torch.tensor([list(prompt_ids) + list(gen_ids)], device=self.device)
        self._check_ids(ids, "prompt_ids/gen_ids")
        return self.sequence_logprobs(ids, temperature)[0, len(prompt_ids) - 1 :].cpu()

    def _check_ids(self, ids: torch.Tensor, field: str) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"{field} contains token ids outside [0, {self.vocab_size})")
        if ids.shape[-1] > self.max_seq_len:
            raise ValueError(f"{field} is {ids.shape[-1]} tokens, over max_seq_len={self.max_seq_len}")

    # ----- decoding ------------------------------------------------------
    @torch.no_grad()
    def sample(self, prompt_ids, max_new_tokens: int, temperature: float = 1.0, stop_token: int | None = None,
               generator: torch.Generator | None = None) -> tuple[list[int], list[float]]:
        out = self.sample_batch([prompt_ids], [max_new_tokens], [temperature], stop_token, generator)[0]
        return out.token_ids, out.logprobs

    @torch.no_grad()
    def sample_batch(self, prompts: list[list[int]], max_new_tokens: list[int], temperatures: list[float],
                     stop_token: int | None = None, generator: torch.Generator | None = None,
                     pad_id: int = 0) -> list[SampleOutput]:
        """Decode several prompts at once (left padding + KV cache).

        Logprobs are of the sampled token under ``logits / temperature``; a
        temperature <= 0 means greedy, scored at temperature 1. A row stops at
        ``stop_token`` (kept in its output) or at its own ``max_new_tokens``,
        capped so prompt + generation fits ``max_seq_len``.
        """
        B = len(prompts)
        if not (B == len(max_new_tokens) == len(temperatures)):
            raise ValueError("prompts, max_new_tokens and temperatures must have the same length")
        dev = self.device
        lens = [len(p) for p in prompts]
        for i, n in enumerate(lens):
            if n == 0:
                raise ValueError(f"prompt {i} is empty")
            if n >= self.max_seq_len:
                raise ValueError(f"prompt {i} is {n} tokens; max_seq_len={self.max_seq_len} leaves no room to generate")
        limits = [min(int(m), self.max_seq_len - n) for m, n in zip(max_new_tokens, lens)]
        L = max(lens)
        ids = torch.full((B, L), pad_id, dtype=torch.long)
        keymask = torch.zeros((B, L), dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.as_tensor(p, dtype=torch.long)
            keymask[i, L - len(p):] = True
        ids, keymask = ids.to(dev), keymask.to(dev)
        self._check_ids(ids, "prompt_ids")
        positions = (keymask.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.tril(torch.ones(L, L, dtype=torch.bool, device=dev))
        eye = torch.eye(L, dtype=torch.bool, device=dev)
        mask = (keymask[:, None, None, :] & causal) | eye  # a pad query attends to itself only
        logits, cache = self.forward(ids, positions, mask, return_cache=True)
        last = logits[:, -1].float()
        temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=dev)[:, None]
        greedy = torch.tensor([t <= 0 for t in temperatures], device=dev)
        next_pos = torch.tensor(lens, device=dev)
        outs = [SampleOutput([], [], "length") for _ in range(B)]
        active = [lim > 0 for lim in limits]
        while any(active):
            logp = torch.log_softmax(last / temps, dim=-1)
            sampled = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            tok = torch.where(greedy, logp.argmax(-1), sampled)
            tok_lp = logp.gather(-1, tok[:, None]).squeeze(-1)
            tok_l, lp_l = tok.tolist(), tok_lp.tolist()
            for i in range(B):
                if not active[i]:
                    continue
                outs[i].token_ids.append(tok_l[i])
                outs[i].logprobs.append(lp_l[i])
                if stop_token is not None and tok_l[i] == stop_token:
                    outs[i].finish_reason = "stop"
                    active[i] = False
                elif len(outs[i].token_ids) >= limits[i]:
                    active[i] = False
            if not any(active):
                break
            keymask = torch.cat([keymask, torch.ones((B, 1), dtype=torch.bool, device=dev)], dim=1)
            step_mask = keymask[:, None, None, :]
            logits, cache = self.forward(tok[:, None], next_pos[:, None], step_mask, cache, return_cache=True)
            last = logits[:, -1].float()
            next_pos = next_pos + 1
        return outs


def build_policy(cfg: PolicyConfig, vocab_size: int, device: str | torch.device | None = None) -> CausalTransformerPolicy:
    """Build the policy on ``cfg.device`` (or an explicit device)."""
    dev = resolve_device(cfg.device) if device is None else torch.device(device)
    return CausalTransformerPolicy(cfg, vocab_size).to(dev)
