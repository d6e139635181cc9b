"""GRPO's clipped policy-gradient loss (token level, masked mean).

Per token t with ratio r = exp(logprob - old_logprob) and advantage A:

    pg_t = max(-A * r, -A * clip(r, 1 - clip_min, 1 + clip_max))

The max of the two negated objectives is PPO's pessimistic bound: a positive
advantage stops pushing once r > 1 + clip_max, a negative one once
r < 1 - clip_min. With a reference policy the k3 estimator of KL(pi || ref),
exp(ref - logprob) - (ref - logprob) - 1 (non-negative, unbiased), is added
with weight ``kl_coef``. The loss is the sum over unmasked tokens divided by
``normalizer`` (default: the number of unmasked tokens), so micro-batches of
one global batch can each pass the global token count and their gradients add
up to the gradient of the global token-mean.
"""

from __future__ import annotations

import torch


def clipped_pg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_min: float,
    clip_max: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (loss, metrics). Shapes: [B, T] for all token tensors; advantages [B, T] or [B]."""
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must have the same shape"
        )
    if clip_min < 0 or clip_max < 0:
        raise ValueError(f"clip_min/clip_max must be >= 0, got {clip_min}/{clip_max}")
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(logprobs)
    on = mask.bool()
    mask = mask.to(logprobs.dtype)
    n_tokens = float(mask.sum())
    denom = n_tokens if normalizer is None else float(normalizer)
    if denom <= 0:
        raise ValueError("clipped_pg_loss needs at least one unmasked token (or a positive normalizer)")

    zero = torch.zeros_like(logprobs)
    # Masked tokens get log-ratio 0 via where(), so garbage (even inf) there cannot leak into loss or grads.
    log_ratio = torch.where(on, logprobs - old_logprobs.detach(), zero)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_min, 1.0 + clip_max)
    per_token = torch.maximum(unclipped, clipped)
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None and kl_coef > 0:
        d = torch.where(on, ref_logprobs.detach() - logprobs, zero)
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + kl_coef * kl
    loss = torch.where(on, per_token, zero).sum() / denom

    with torch.no_grad():
        m = mask.bool()
        n = max(n_tokens, 1.0)
        metrics = {
            "pg_clip_frac": float(((clipped > unclipped) & m).sum()) / n,
            "ratio_mean": float((ratio * mask).sum()) / n,
            "kl_ref": float((kl * mask).sum()) / n,
            "approx_kl_old": float((0.5 * log_ratio.pow(2) * mask).sum()) / n,
            "num_tokens": n_tokens,
        }
    return loss, metrics
