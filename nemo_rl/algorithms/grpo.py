"""GRPO: group-relative advantages and a trainer that owns the policy weights.

Each sealed rollout gets one advantage from its reward relative to its prompt
group. Every model call of the rollout is a training sequence (its own
prompt + generated tokens, exactly as the generation worker produced them), the
prompt masked and the generated tokens trained with that advantage. One call
to ``train_step`` is one optimizer step and bumps ``weight_version`` by one;
the caller ships ``state_dict_for_refit()`` to the generation workers. A step
can also be fed group by group as groups complete (``open_step``: see
``GRPOStreamingStep``); ``train_step`` is that with a single add. With
``grpo.deterministic`` the trainer takes each add's samples in one canonical
order (group position, then sibling index: ``canonical_order``) and keeps what
the step trained, sample by sample, as ``last_trace`` (``nemo_rl.parity.trace``).

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
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Callable

import torch

from nemo_rl.algorithms.grpo_config import GRPOConfig, LossConfig, PolicyConfig
from nemo_rl.algorithms.loss_functions import clipped_pg_loss
from nemo_rl.algorithms.single_controller_utils.interfaces import StepLedger, already_open
from nemo_rl.experience.sample import RolloutSample
from nemo_rl.models.policy import HFPolicy
from nemo_rl.parity.trace import TracedSample, canonical_order, trace_samples
from gym_patches.checkpoint.storage import StorageWriter
from nemo_rl.utils.atomic_write import PLAIN_FILES, write_bytes_atomic, write_stream_atomic
from nemo_rl.utils.write_errors import as_write_error, naming_write, newest_file

CHECKPOINT_FORMAT = "nemo_rl.grpo_trainer.v2"
_MAX_SHARD_SIZE = "50GB"  # transformers 5's default, given explicitly so a failed shard can be named
# config.json fields that must agree between a checkpoint and the model it is loaded into.
_ARCH_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size")
# Per-token loss metrics: summed weighted by each micro-batch's tokens, reported as the mean over trained tokens.
_TOKEN_METRICS = ("pg_clip_frac", "ratio_mean", "kl_ref", "approx_kl_old")


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


def _hf_save(directory: Path, staged: Path, save: Callable[[], Any], weights: Sequence[str] = ()) -> None:
    """Run a Hugging Face ``save_pretrained`` into ``staged`` (the writer's staging directory for
    ``directory``); a failed write leaves as ``RunWriteError`` naming its file under ``directory``.

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
            path = next((staged / w for w in weights if not (staged / w).exists()), staged / weights[-1])
        else:
            path = newest_file(staged, started) or staged
        if Path(path).is_relative_to(staged):
            path = directory / Path(path).relative_to(staged)
        converted = as_write_error(exc, path)
        if converted is None or converted is exc:
            raise
        raise converted from exc


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _torch_file(path: Path, obj: Any, writer: StorageWriter) -> None:
    """``obj`` streamed by ``torch.save`` through ``writer``: no second copy of it in memory."""
    write_stream_atomic(path, lambda out: torch.save(obj, out), writer)


class GRPOTrainer:
    """Owns the training copy of the policy, its optimizer, and the step / weight version counters."""

    def __init__(self, policy_cfg: PolicyConfig, loss_cfg: LossConfig, grpo_cfg: GRPOConfig, policy: HFPolicy,
                 *, weights_from: str | os.PathLike | None = None):
        """``weights_from``: the checkpoint directory ``policy`` was just loaded from (a restore builds
        the policy from the step it restores), so ``load`` of that directory does not read the weights
        again (docs/design.md §5.6)."""
        self.policy_cfg, self.loss_cfg, self.grpo_cfg = policy_cfg, loss_cfg, grpo_cfg
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.optimizer = self._make_optimizer()
        self.reference: HFPolicy | None = None
        self.step = 0
        self.weight_version = 0
        # Bumped whenever the weights change (an optimizer step, a load that reads weights): a generation
        # backend that already serves (weights_serial, weight_version) has nothing to ship.
        self.weights_serial = 0
        # (directory, serial): the policy holds exactly that directory's weights while the serial is unchanged.
        self._weights_from = None if weights_from is None else (Path(weights_from).resolve(), 0)
        self.dataloader_state: dict = {}
        # Guards the open step and the weights' update against save/load from another thread.
        self._lock = threading.RLock()
        self._open: GRPOStreamingStep | None = None
        self.last_trace: list[TracedSample] | None = None  # deterministic: the last finished step's samples

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
    def _grouped(self, samples: list[RolloutSample]) -> "OrderedDict[str, list[RolloutSample]]":
        """``samples`` by prompt group, groups in first-seen order; deterministic: canonical order first."""
        groups: "OrderedDict[str, list[RolloutSample]]" = OrderedDict()
        for s in canonical_order(samples) if self.grpo_cfg.deterministic else samples:
            groups.setdefault(s.group_id, []).append(s)
        return groups

    def _build(self, samples: list[RolloutSample]) -> tuple[list[_Seq], list[list[float]]]:
        """The training sequences of ``samples`` and each prompt group's advantages (``_grouped`` order)."""
        groups = self._grouped(samples)
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
        return seqs, advs

    @staticmethod
    def _reward_stats(samples: list[RolloutSample], advs: list[list[float]]) -> dict[str, float]:
        all_adv = [a for g in advs for a in g]
        rewards = [s.reward for s in samples]
        mean_r = sum(rewards) / len(rewards)
        return {
            "reward_mean": mean_r,
            "reward_std": math.sqrt(sum((r - mean_r) ** 2 for r in rewards) / len(rewards)),
            "reward_max": max(rewards),
            "advantage_abs_mean": sum(abs(a) for a in all_adv) / len(all_adv),
            "num_rollouts": float(len(samples)),
            "num_groups": float(len(advs)),
            "groups_with_signal": float(sum(any(a != 0 for a in g) for g in advs)),
        }

    def _sequences(self, samples: list[RolloutSample]) -> tuple[list[_Seq], dict[str, float]]:
        """The training sequences of ``samples`` and their reward statistics."""
        seqs, advs = self._build(samples)
        return seqs, self._reward_stats(samples, advs)

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
    def open_step(self) -> "GRPOStreamingStep":
        """Start one optimizer step fed whole prompt groups as they complete; one open at a time."""
        with self._lock:
            if self._open is not None:
                raise already_open("GRPOTrainer", self._open)
            self.optimizer.zero_grad(set_to_none=True)
            self._open = GRPOStreamingStep(self)
            return self._open

    def _release(self, step: "GRPOStreamingStep") -> None:
        with self._lock:
            if self._open is step:
                self._open = None

    def train_step(self, samples: list[RolloutSample]) -> dict[str, float]:
        """One optimizer step on a batch of sealed rollouts; returns metrics (a streaming step with one add)."""
        step = self.open_step()
        try:
            step.add(samples)
            return step.finish()
        finally:
            step.abort()  # no-op once finished; a rejected batch must not keep the trainer's step open

    # ----- weights out ---------------------------------------------------
    def state_dict_for_refit(self) -> dict[str, torch.Tensor]:
        """CPU copy of the policy weights (what ``GenerationWorker.refit`` takes)."""
        return self.policy.state_dict_cpu()

    def state_dict_bytes(self) -> bytes:
        return _torch_bytes(self.state_dict_for_refit())

    def weights_now(self, deadline: float | None = None, stop: Callable[[], bool] = lambda: False
                    ) -> tuple[bytes, int, int]:
        """The weights as bytes with their ``weights_serial`` and ``weight_version``, read together while no
        step updates them: what a generation worker started mid-step is given (docs/design.md §5.12). A
        step or a checkpoint save holds them for as long as it runs: past ``deadline`` (``time.monotonic()``)
        or once ``stop()`` says so, ``TimeoutError``, so a restart never waits on them unbounded."""
        while not self._lock.acquire(timeout=0.1):
            if stop() or (deadline is not None and time.monotonic() >= deadline):
                raise TimeoutError("the trainer's weights were busy (a step or a checkpoint save) past the deadline")
        try:
            return self.state_dict_bytes(), self.weights_serial, self.weight_version
        finally:
            self._lock.release()

    # ----- checkpoint ----------------------------------------------------
    def save(self, directory: str | os.PathLike, dataloader_state: dict | None = None, *,
             writer: StorageWriter = PLAIN_FILES) -> Path:
        """Hugging Face model + tokenizer, optimizer, reference, RNG; ``trainer_state.json`` goes last.
        Every file goes through ``writer`` (the run store's, in a run; plain files for a direct call).

        A file that cannot be written (disk full, I/O error) raises ``RunWriteError`` naming it, so
        the run ends with one line instead of a library traceback.
        """
        with self._lock:  # never between a step's optimizer update and its counter bump
            return self._save(Path(directory), dataloader_state, writer)

    def _save(self, d: Path, dataloader_state: dict | None, writer: StorageWriter) -> Path:
        with naming_write(d):
            writer.make_dirs(d)
        if dataloader_state is not None:
            if not isinstance(dataloader_state, dict):
                raise TypeError(f"dataloader_state must be a dict, got {type(dataloader_state).__name__}")
            self.dataloader_state = copy.deepcopy(dataloader_state)
        model = self.policy.model
        # Hugging Face writes its files itself: into the writer's staging directory, which it commits.
        # (A failure names its file: _hf_save for a write, the writer for a put.)
        with naming_write(None), writer.staging(d) as staged:
            _hf_save(d, staged, lambda: model.save_pretrained(staged, max_shard_size=_MAX_SHARD_SIZE),
                     _weights_files(model))
            _hf_save(d, staged, lambda: self.tokenizer.save_pretrained(staged))
        _torch_file(d / "optimizer.pt", self.optimizer.state_dict(), writer)
        if self.reference is not None:
            _torch_file(d / "reference.pt", self.reference.state_dict_cpu(), writer)
        elif (d / "reference.pt").exists():
            writer.remove(d / "reference.pt")
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        _torch_file(d / "rng.pt", rng, writer)
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
        write_bytes_atomic(d / "trainer_state.json", json.dumps(state, indent=1).encode(), writer)
        return d

    def load(self, directory: str | os.PathLike) -> dict:
        """Restore a ``save``d directory into this trainer; returns the saved ``dataloader_state``.
        The weights files are not read when the policy already holds that directory's weights
        (``weights_from``, or an earlier load, and no step since); everything else is."""
        with self._lock:
            if self._open is not None:
                raise RuntimeError(f"GRPOTrainer.load({str(directory)!r}): a streaming step is open; "
                                   "finish() or abort() it before loading a checkpoint")
            return self._load(Path(directory))

    def _load(self, d: Path) -> dict:
        from transformers import AutoConfig

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
        if self._weights_from != (d.resolve(), self.weights_serial):  # else the policy holds them already
            self._load_weights(d)
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


    def _load_weights(self, d: Path) -> None:
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for f in sorted(d.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        if not weights:
            raise FileNotFoundError(f"{d}: no *.safetensors weights")
        self.policy.load_state(weights)
        self.weights_serial += 1
        self._weights_from = (d.resolve(), self.weights_serial)


class GRPOStreamingStep:
    """One optimizer step fed whole prompt groups as they complete (``GRPOTrainer.open_step``).

    Each ``add`` computes its groups' advantages, old / reference logprobs and
    forward + backward at once, so training overlaps the step's remaining
    generation. The loss is a mean over the step's generated tokens, a count
    known only once the last group is in: each add backpropagates the
    un-normalised sum (normalizer 1) and ``finish`` divides every gradient by
    the total before clipping and the optimizer step. The weights do not move
    until ``finish``, so this is the same update, and the same metrics, as one
    ``train_step`` over everything added. Adds may come from any thread; they
    run one at a time.
    """

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer
        self.ledger = StepLedger("GRPOStreamingStep")
        self._lock = threading.Lock()
        self._samples: list[RolloutSample] = []
        self._advs: list[list[float]] = []
        self._n_adds = self._n_seqs = self._n_active = self._tokens = self._active_tokens = self._micro_batches = 0
        self._loss_sum = self._lp_err = self._lp_err_n = self._busy_s = 0.0
        self._agg = dict.fromkeys(_TOKEN_METRICS, 0.0)
        self._min_version: int | None = None
        self._trace: list[TracedSample] = []

    def add(self, samples: list[RolloutSample]) -> None:
        """Train on whole prompt groups (gradients accumulate); a group already in this step is a ValueError."""
        with self._lock:
            t0 = time.perf_counter()
            self.ledger.check_open("add")
            samples = [s if isinstance(s, RolloutSample) else RolloutSample.model_validate(s) for s in samples]
            group_ids = self.ledger.new_groups(samples)
            seqs, advs = self.trainer._build(samples)  # every rejection happens before any gradient exists
            try:
                self._accumulate(seqs)
            except BaseException as exc:
                self._fail("add", exc)
                raise
            self.ledger.commit(group_ids)
            if self.trainer.grpo_cfg.deterministic:  # the statistics' sums too follow the canonical order
                samples = [s for g in self.trainer._grouped(samples).values() for s in g]
                self._trace += trace_samples(samples, [a for g in advs for a in g])
            self._samples.extend(samples)
            self._advs.extend(advs)
            self._n_adds += 1
            self._n_seqs += len(seqs)
            self._tokens += sum(len(s.ids) - s.n_prompt for s in seqs)
            if seqs:
                low = min(s.version for s in seqs)
                self._min_version = low if self._min_version is None else min(self._min_version, low)
            self._busy_s += time.perf_counter() - t0

    def _accumulate(self, seqs: list[_Seq]) -> None:
        t = self.trainer
        kl_coef = t.loss_cfg.reference_policy_kl_penalty
        if kl_coef > 0 and t.reference is None:
            t.reset_reference()
        # Zero-advantage sequences add exactly nothing without KL; they still count in the token mean.
        active = sorted((s for s in seqs if s.adv != 0.0 or kl_coef > 0), key=lambda s: len(s.ids))
        mb = t.policy_cfg.train_micro_batch_size
        batches = [t._pad(active[i: i + mb]) for i in range(0, len(active), mb)]
        temp = t.temperature
        t.policy.train()
        old_lps, ref_lps = [], []
        with torch.no_grad():
            for ids, mask, gen_lp, _ in batches:
                prev = t.policy.sequence_logprobs(ids, temp)
                self._lp_err += float(((prev - gen_lp).abs() * mask).sum())
                self._lp_err_n += float(mask.sum())
                old_lps.append(gen_lp if t.grpo_cfg.use_generation_logprobs else prev)
                ref_lps.append(t.reference.sequence_logprobs(ids, temp) if kl_coef > 0 else None)
        for (ids, mask, _, adv), old, ref in zip(batches, old_lps, ref_lps):
            lp = t.policy.sequence_logprobs(ids, temp)
            loss, m = clipped_pg_loss(
                lp, old, adv, mask, t.loss_cfg.ratio_clip_min, t.loss_cfg.ratio_clip_max,
                ref_logprobs=ref, kl_coef=kl_coef, normalizer=1.0,
            )
            loss.backward()
            self._loss_sum += loss.item()
            for k in _TOKEN_METRICS:
                self._agg[k] += m[k] * m["num_tokens"]
        self._micro_batches += len(batches)
        self._n_active += len(active)
        self._active_tokens += sum(len(s.ids) - s.n_prompt for s in active)

    def finish(self) -> dict[str, float]:
        """Normalise the gradients by the step's token count, clip, step the optimizer; returns the metrics."""
        with self._lock:
            t0 = time.perf_counter()
            self.ledger.check_finish()
            t = self.trainer
            n = max(self._tokens, 1)
            try:
                with t._lock:
                    for p in t.policy.parameters():
                        if p.grad is not None:
                            p.grad.div_(n)
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(t.policy.parameters(), t.policy_cfg.max_grad_norm))
                    if self._micro_batches:
                        t.optimizer.step()
                    t.optimizer.zero_grad(set_to_none=True)
                    t.step += 1
                    t.weight_version += 1
                    t.weights_serial += 1
            except BaseException as exc:
                self._fail("finish", exc)
                raise
            self.ledger.close("finished")
            t.last_trace = self._trace if t.grpo_cfg.deterministic else None
            t._release(self)
            lag = float(t.weight_version - 1 - self._min_version) if self._min_version is not None else 0.0
            return {
                "step": float(t.step),
                "weight_version": float(t.weight_version),
                "loss": self._loss_sum / n,
                **t._reward_stats(self._samples, self._advs),
                "num_sequences": float(self._n_seqs),
                "num_trained_sequences": float(self._n_active),
                "num_gen_tokens": float(self._tokens),
                "mean_gen_tokens": self._tokens / max(self._n_seqs, 1),
                "calls_per_rollout": self._n_seqs / len(self._samples),
                **{k: v / max(self._active_tokens, 1) for k, v in self._agg.items()},
                "gen_logprob_abs_err": self._lp_err / max(self._lp_err_n, 1.0),
                "max_weight_version_lag": lag,
                "grad_norm": grad_norm,
                "lr": t.optimizer.param_groups[0]["lr"],
                "num_adds": float(self._n_adds),
                # Time the trainer worked on this step (adds and finish), not the wait for groups between adds.
                "train_s": self._busy_s + time.perf_counter() - t0,
            }

    def abort(self) -> None:
        """Drop what was added: gradients cleared, weights, optimizer and counters untouched. No-op once closed."""
        with self._lock:
            if self.ledger.closed is None:
                self._close("aborted")

    def _fail(self, where: str, exc: BaseException) -> None:
        self._close(f"failed in {where} ({type(exc).__name__}: {exc})")

    def _close(self, why: str) -> None:
        # Partial gradient sums must not leak into the next step.
        self.trainer.optimizer.zero_grad(set_to_none=True)
        self.ledger.close(why)
        self.trainer._release(self)
