"""The embedded default's "pretrained model" (``policy.model_name: tiny-causal-lm``): the cached base of
``nemo_rl.models.tiny_model`` plus a supervised warm start on the rows' demonstrations
(``nemo_rl.algorithms.warm_start``), cached by recipe. Here, not in the model layer, because the warm start
is training."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nemo_rl.algorithms.warm_start import simulate_rows, warm_start
from nemo_rl.models.policy_config import PolicyConfig
from nemo_rl.models.tiny_model import ensure_base, is_cached, save_warm, warm_dir


def ensure_pretrained(policy_cfg: PolicyConfig, rows: list[dict], seed: int, log: Callable[[str], None] = print,
                      progress: bool = True) -> Path:
    """The embedded default's "pretrained model": base + warm start, cached by recipe."""
    import torch

    from nemo_rl.models.policy import load_policy

    ws = policy_cfg.warm_start
    final = warm_dir(policy_cfg, rows, seed)
    if is_cached(final):
        log(f"Embedded model: reusing the cached warm start ({ws.steps} steps) in {final}")
        return final
    convs = simulate_rows(rows)
    base = ensure_base(policy_cfg, rows, log, conversations=convs)
    if ws.steps == 0:
        return base
    policy = load_policy(str(base), policy_cfg.dtype, policy_cfg.device, policy_cfg.max_seq_len)
    log(f"Warm start: {ws.steps} supervised steps on {len(rows)} rows' demonstrations (cached afterwards)...")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        metrics = warm_start(policy, rows, steps=ws.steps, batch_size=ws.batch_size, lr=ws.learning_rate,
                             seed=seed, label_smoothing=ws.label_smoothing, conversations=convs, progress=progress)
    save_warm(policy, final, policy_cfg, seed, metrics)
    log(f"Warm start done: loss {metrics['warm_start_loss']:.3f} in {metrics['warm_start_s']:.1f}s; cached in {final}")
    return final
