"""GRPO: group-relative advantages and a trainer that owns the policy weights.

Each sealed rollout gets one advantage from its reward relative to its prompt
group. Every model call of the rollout is a training sequence (its own
prompt + generated tokens, exactly as the generation worker produced them), the
prompt masked and the generated tokens trained with that advantage. One call
to ``train_step`` is one optimizer step and bumps ``weight_version`` by one;
the caller ships ``state_dict_for_refit()`` to the generation workers.

The policy is a Hugging Face causal LM (``nemo_rl.models.policy.HFPolicy``);
the logprobs of the loss come from the same model class the generation worker
decodes with. Checkpoints are Hugging Face model directories
(``save_pretrained``: ``config.json``, ``model.safetensors``, the tokenizer
files) plus ``optimizer.pt``, ``rng.pt``, ``reference.pt`` (with a KL
reference) and, written last, ``trainer_state.json``: ``from_pretrained`` and
vLLM load them as they are.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_rl.algorithms.grpo_config import GRPOConfig, LossConfig, PolicyConfig
from nemo_rl.algorithms.loss_functions import clipped_pg_loss
from nemo_rl.experience.sample import RolloutSample
from nemo_rl.models.policy import HFPolicy
from nemo_rl.utils.snapshot_store import write_bytes_atomic
from nemo_rl.utils.write_errors import as_write_error, naming_write, newest_file

CHECKPOINT_FORMAT = "nemo_rl.grpo_trainer.v2"
_MAX_SHARD_SIZE = "50GB"  # transformers 5's default, given explicitly so a failed shard can be named
# config.json fields that must agree between a checkpoint and the model it is loaded into.
_ARCH_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size")


def compute_group_advantages(
    rewards: Sequence[Sequence[float]], normalize: bool = True, eps: float = 1e-6
) -> list[list[float]]:
    """Per group: reward minus the group mean, divided by the group's sample std when ``normalize``.

    A group of one, or a group whose rewards are all equal, gets advantage 0:
    it says nothing about which behaviour is better.
    """
    out: list[list[float]] = []
    for gi, group in enumerate(rewards):
        r = torch.tensor([float(x) for x in group], dtype=torch.float64)
        if r.numel() == 0:
            raise ValueError(f"reward group {gi} is empty")
        if not torch.isfinite(r).all():
            raise ValueError(f"reward group {gi} has a non-finite reward: {list(group)}")
        if r.numel() == 1:
            out.append([0.0])
            continue
        adv = r - r.mean()
        if normalize:
            std = r.std(unbiased=True)
            adv = adv / (std + eps) if std > 0 else torch.zeros_like(adv)
        out.append(adv.tolist())
    return out


class _Seq:
    __slots__ = ("ids", "n_prompt", "adv", "gen_lp", "version")

    def __init__(self, ids, n_prompt, adv, gen_lp, version):
        self.ids, self.n_prompt, self.adv, self.gen_lp, self.version = ids, n_prompt, adv, gen_lp, version


def _weights_files(model: Any) -> list[str]:
    """The safetensors files ``save_pretrained(max_shard_size=_MAX_SHARD_SIZE)`` writes, in order."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(model.state_dict(), filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=_MAX_SHARD_SIZE)
    return list(split.filename_to_tensors)


def _hf_save(directory: Path, save: Callable[[], Any], weights: Sequence[str] = ()) -> None:
    """Run a Hugging Face ``save_pretrained``; a failed write leaves as ``RunWriteError`` naming its file.

    Neither safetensors' ``SafetensorError (os error N)`` nor an ``OSError`` from ``write()`` names
    the file, so it is found here: a failed weights shard is not left on disk (safetensors removes
    it), so it is the first of ``weights`` missing; any other file is the newest one in the directory.
    """
    started = time.time()
    try:
        save()
    except Exception as exc:
        if isinstance(exc, OSError) and exc.filename:
            path: Path | str = exc.filename
        elif not isinstance(exc, OSError) and weights:
            path = next((directory / w for w in weights if not (directory / w).exists()), directory / weights[-1])
        else:
            path = newest_file(directory, started) or directory
        converted = as_write_error(exc, path)
        if converted is None or converted is exc:
            raise
        raise converted from exc


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class GRPOTrainer:
    """Owns the training copy of the policy, its optimizer, and the step / weight version counters."""

    def __init__(self, policy_cfg: PolicyConfig, loss_cfg: LossConfig, grpo_cfg: GRPOConfig, policy: HFPolicy):
        self.policy_cfg, self.loss_cfg, self.grpo_cfg = policy_cfg, loss_cfg, grpo_cfg
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.optimizer = self._make_optimizer()
        self.reference: HFPolicy | None = None
        self.step = 0
        self.weight_version = 0
        self.dataloader_state: dict = {}

    def _make_optimizer(self) -> torch.optim.Optimizer:
        c = self.policy_cfg
        return torch.optim.AdamW(
            self.policy.parameters(), lr=c.learning_rate, betas=tuple(c.adam_betas), weight_decay=c.weight_decay
        )

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def temperature(self) -> float:
        return self.policy_cfg.generation.temperature

    def reset_reference(self) -> None:
        """Freeze the current weights as the KL reference (call after a warm start)."""
        model = copy.deepcopy(self.policy.model).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.reference = HFPolicy(model, self.policy.tokenizer, self.policy.max_seq_len)

    # ----- batching ------------------------------------------------------
    def _sequences(self, samples: list[RolloutSample]) -> tuple[list[_Seq], dict[str, float]]:
        groups: "OrderedDict[str, list[RolloutSample]]" = OrderedDict()
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        advs = compute_group_advantages(
            [[s.reward for s in g] for g in groups.values()], normalize=self.grpo_cfg.normalize_rewards
        )
        seqs: list[_Seq] = []
        for g, g_adv in zip(groups.values(), advs):
            for s, a in zip(g, g_adv):
                for ci, call in enumerate(s.calls):
                    if not call.generation_token_ids:
                        continue
                    if not call.prompt_token_ids:
                        raise ValueError(f"rollout {s.rollout_id!r} call {ci}: prompt_token_ids is empty")
                    ids = call.prompt_token_ids + call.generation_token_ids
                    if len(ids) > self.policy.max_seq_len:
                        raise ValueError(
                            f"rollout {s.rollout_id!r} call {ci}: {len(ids)} tokens exceed "
                            f"policy.max_seq_len={self.policy.max_seq_len}"
                        )
                    if max(ids) >= self.policy.vocab_size or min(ids) < 0:
                        raise ValueError(f"rollout {s.rollout_id!r} call {ci}: token id outside the vocabulary")
                    seqs.append(_Seq(ids, len(call.prompt_token_ids), a, call.generation_log_probs, call.weight_version))
        all_adv = [a for g in advs for a in g]
        rewards = [s.reward for s in samples]
        mean_r = sum(rewards) / len(rewards)
        stats = {
            "reward_mean": mean_r,
            "reward_std": math.sqrt(sum((r - mean_r) ** 2 for r in rewards) / len(rewards)),
            "reward_max": max(rewards),
            "advantage_abs_mean": sum(abs(a) for a in all_adv) / len(all_adv),
            "num_rollouts": float(len(samples)),
            "num_groups": float(len(groups)),
            "groups_with_signal": float(sum(any(a != 0 for a in g) for g in advs)),
        }
        return seqs, stats

    def _pad(self, batch: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        T = max(len(s.ids) for s in batch)
        ids = torch.full((len(batch), T), self.policy.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), T - 1))
        gen_lp = torch.zeros((len(batch), T - 1))
        for i, s in enumerate(batch):
            ids[i, : len(s.ids)] = torch.tensor(s.ids)
            lo, hi = s.n_prompt - 1, len(s.ids) - 1  # logprob index j scores token j+1
            mask[i, lo:hi] = 1.0
            gen_lp[i, lo:hi] = torch.tensor(s.gen_lp, dtype=torch.float32)
        adv = torch.tensor([s.adv for s in batch], dtype=torch.float32)
        dev = self.device
        return ids.to(dev), mask.to(dev), gen_lp.to(dev), adv.to(dev)

    # ----- training ------------------------------------------------------
    def train_step(self, samples: list[RolloutSample]) -> dict[str, float]:
        """One optimizer step on a batch of sealed rollouts; returns metrics."""
        t0 = time.perf_counter()
        if not samples:
            raise ValueError("train_step needs at least one RolloutSample")
        samples = [s if isinstance(s, RolloutSample) else RolloutSample.model_validate(s) for s in samples]
        seqs, stats = self._sequences(samples)
        kl_coef = self.loss_cfg.reference_policy_kl_penalty
        if kl_coef > 0 and self.reference is None:
            self.reset_reference()
        total_tokens = sum(len(s.ids) - s.n_prompt for s in seqs)
        # Zero-advantage sequences add exactly nothing without KL; they still count in the token mean.
        active = [s for s in seqs if s.adv != 0.0 or kl_coef > 0]
        active.sort(key=lambda s: len(s.ids))
        mb = self.policy_cfg.train_micro_batch_size
        batches = [active[i : i + mb] for i in range(0, len(active), mb)]
        temp = self.temperature
        self.policy.train()

        old_lps, ref_lps, lp_err, lp_err_n = [], [], 0.0, 0.0
        with torch.no_grad():
            for b in batches:
                ids, mask, gen_lp, _ = self._pad(b)
                prev = self.policy.sequence_logprobs(ids, temp)
                lp_err += float(((prev - gen_lp).abs() * mask).sum())
                lp_err_n += float(mask.sum())
                old_lps.append(gen_lp if self.grpo_cfg.use_generation_logprobs else prev)
                ref_lps.append(self.reference.sequence_logprobs(ids, temp) if kl_coef > 0 else None)

        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        agg = dict.fromkeys(("pg_clip_frac", "ratio_mean", "kl_ref", "approx_kl_old"), 0.0)
        for b, old, ref in zip(batches, old_lps, ref_lps):
            ids, mask, _, adv = self._pad(b)
            lp = self.policy.sequence_logprobs(ids, temp)
            loss, m = clipped_pg_loss(
                lp, old, adv, mask, self.loss_cfg.ratio_clip_min, self.loss_cfg.ratio_clip_max,
                ref_logprobs=ref, kl_coef=kl_coef, normalizer=max(total_tokens, 1),
            )
            loss.backward()
            loss_sum += loss.item()
            for k in ("pg_clip_frac", "ratio_mean", "kl_ref", "approx_kl_old"):
                agg[k] += m[k] * m["num_tokens"]
        n_active_tok = sum(len(s.ids) - s.n_prompt for s in active)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.policy_cfg.max_grad_norm))
        if batches:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.weight_version += 1

        versions = [s.version for s in seqs]
        metrics = {
            "step": float(self.step),
            "weight_version": float(self.weight_version),
            "loss": loss_sum,
            **stats,
            "num_sequences": float(len(seqs)),
            "num_trained_sequences": float(len(active)),
            "num_gen_tokens": float(total_tokens),
            "mean_gen_tokens": total_tokens / max(len(seqs), 1),
            "calls_per_rollout": len(seqs) / len(samples),
            **{k: v / max(n_active_tok, 1) for k, v in agg.items()},
            "gen_logprob_abs_err": lp_err / max(lp_err_n, 1.0),
            "max_weight_version_lag": float(self.weight_version - 1 - min(versions)) if versions else 0.0,
            "grad_norm": grad_norm,
            "lr": self.optimizer.param_groups[0]["lr"],
            "train_s": time.perf_counter() - t0,
        }
        return metrics

    # ----- weights out ---------------------------------------------------
    def state_dict_for_refit(self) -> dict[str, torch.Tensor]:
        """CPU copy of the policy weights (what ``GenerationWorker.refit`` takes)."""
        return self.policy.state_dict_cpu()

    def state_dict_bytes(self) -> bytes:
        return _torch_bytes(self.state_dict_for_refit())

    # ----- checkpoint ----------------------------------------------------
    def save(self, directory: str | os.PathLike, dataloader_state: dict | None = None) -> Path:
        """Hugging Face model + tokenizer, optimizer, reference, RNG; ``trainer_state.json`` goes last.

        A file that cannot be written (disk full, I/O error) raises ``RunWriteError`` naming it, so
        the run ends with one line instead of a library traceback.
        """
        d = Path(directory)
        with naming_write(d):
            d.mkdir(parents=True, exist_ok=True)
        if dataloader_state is not None:
            if not isinstance(dataloader_state, dict):
                raise TypeError(f"dataloader_state must be a dict, got {type(dataloader_state).__name__}")
            self.dataloader_state = copy.deepcopy(dataloader_state)
        model = self.policy.model
        _hf_save(d, lambda: model.save_pretrained(d, max_shard_size=_MAX_SHARD_SIZE), _weights_files(model))
        _hf_save(d, lambda: self.tokenizer.save_pretrained(d))
        write_bytes_atomic(d / "optimizer.pt", _torch_bytes(self.optimizer.state_dict()))
        if self.reference is not None:
            write_bytes_atomic(d / "reference.pt", _torch_bytes(self.reference.state_dict_cpu()))
        elif (d / "reference.pt").exists():
            (d / "reference.pt").unlink()
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        write_bytes_atomic(d / "rng.pt", _torch_bytes(rng))
        state = {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "weight_version": self.weight_version,
            "has_reference": self.reference is not None,
            "dataloader_state": self.dataloader_state,
            "policy_cfg": self.policy_cfg.model_dump(mode="json"),
            "loss_cfg": self.loss_cfg.model_dump(mode="json"),
            "grpo_cfg": self.grpo_cfg.model_dump(mode="json"),
        }
        write_bytes_atomic(d / "trainer_state.json", json.dumps(state, indent=1).encode())
        return d

    def load(self, directory: str | os.PathLike) -> dict:
        """Restore a ``save``d directory into this trainer; returns the saved ``dataloader_state``."""
        from transformers import AutoConfig

        d = Path(directory)
        state_path = d / "trainer_state.json"
        if not state_path.exists():
            raise FileNotFoundError(f"{state_path} is missing: not a complete trainer checkpoint")
        state = json.loads(state_path.read_text())
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{state_path}: field 'format' is {state.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
        saved = AutoConfig.from_pretrained(d).to_dict()
        mine = self.policy.model.config.to_dict()
        for k in _ARCH_FIELDS:
            if saved.get(k) != mine.get(k):
                raise ValueError(f"{d / 'config.json'}: {k}={saved.get(k)!r} but this policy has {mine.get(k)!r}")
        from nemo_rl.models.policy import load_tokenizer

        if load_tokenizer(str(d)).get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"{d}: the saved tokenizer differs from this trainer's tokenizer")
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for f in sorted(d.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        if not weights:
            raise FileNotFoundError(f"{d}: no *.safetensors weights")
        self.policy.load_state(weights)
        dev = self.device
        self.optimizer = self._make_optimizer()
        self.optimizer.load_state_dict(torch.load(d / "optimizer.pt", map_location=dev, weights_only=True))
        if state.get("has_reference"):
            self.reset_reference()
            self.reference.load_state(torch.load(d / "reference.pt", map_location=dev, weights_only=True))
        else:
            self.reference = None
        if (d / "rng.pt").exists():
            rng = torch.load(d / "rng.pt", weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        self.step = int(state["step"])
        self.weight_version = int(state["weight_version"])
        self.dataloader_state = state.get("dataloader_state") or {}
        return copy.deepcopy(self.dataloader_state)
