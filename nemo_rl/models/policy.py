"""The policy: a Hugging Face causal LM, its tokenizer, and what GRPO needs from them.

``HFPolicy`` wraps a ``transformers`` ``AutoModelForCausalLM`` and its tokenizer
and adds the three things the trainer and the generation worker share, so that
"the same model class that generates" also scores:

* ``sample_batch``: batched decoding of left-padded prompts with a KV cache,
  returning each sampled token's logprob under ``logits / temperature``;
* ``sequence_logprobs`` / ``token_logprobs``: rescoring of given tokens;
* the stop tokens (the tokenizer's EOS plus the model's ``generation_config``).

``load_policy`` finds the weights: a local directory, or a hub id (cached
files first; otherwise a metadata probe with a short timeout, so a missing
network or an unknown name fails in seconds, naming ``policy.model_name``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from nemo_rl.models.generation.call_seeds import CallDraws, token_at

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HUB_PROBE_TIMEOUT_S = 10.0
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; asking for cuda without it is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("policy.device is 'cuda' but CUDA is not available")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"policy.device must be auto, cpu or cuda, got {device!r}")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"policy.dtype must be one of {sorted(DTYPES)}, got {dtype!r}") from None


def resolve_model_source(model_name: str, probe_timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str:
    """A local directory holding the model, downloading a hub id if needed.

    Errors are ``ValueError`` naming ``policy.model_name`` and the id; the
    network probe has a timeout, so this never hangs.
    """
    path = Path(model_name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"policy.model_name={model_name!r}: the directory has no config.json (not a Hugging Face model)")
        return str(path)
    if not _HUB_ID.fullmatch(model_name):
        raise ValueError(f"policy.model_name={model_name!r}: no such directory, and not a hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - transformers depends on it
        raise ValueError(f"policy.model_name={model_name!r}: huggingface_hub is not installed ({e})") from None
    patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
    try:
        return snapshot_download(model_name, allow_patterns=patterns, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the local cache: ask the hub
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        raise ValueError(f"policy.model_name={model_name!r}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
    from huggingface_hub import HfApi

    try:
        HfApi().model_info(model_name, timeout=probe_timeout_s)
    except Exception as e:  # noqa: BLE001 - network down, unknown repo, gated, timeout
        raise ValueError(
            f"policy.model_name={model_name!r}: cannot fetch it from the Hugging Face hub "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else 'no detail'}); "
            "pass a local directory or check the id and the network"
        ) from None
    try:
        return snapshot_download(model_name, allow_patterns=patterns, etag_timeout=probe_timeout_s)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"policy.model_name={model_name!r}: download failed ({type(e).__name__}: {e})") from None


def load_tokenizer(source: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    if tok.pad_token_id is None:  # left padding needs some id; it is always masked out
        tok.pad_token = tok.eos_token
    return tok


def load_model(source: str, dtype: str = "float32", device: str | torch.device = "cpu") -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype(dtype))
    return model.to(device)


def stop_token_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    """The tokens that end a reply: the tokenizer's EOS and the model's generation EOS ids."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_cfg = getattr(model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    if not ids:
        raise ValueError(f"model {getattr(model, 'name_or_path', '?')!r} has no EOS token to stop generation")
    return frozenset(ids)


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was emitted; it is kept) or "length"
    # per generated token, the ``top_k`` most likely (token id, logprob) pairs, when asked for
    top: list[list[tuple[int, float]]] = field(default_factory=list)


def _empty_outputs(outputs: list[SampleOutput] | None, rows: int) -> list[SampleOutput]:
    """The outputs ``sample_batch`` fills in place: the caller's (one empty per prompt, so another
    thread can read them while they fill) or fresh ones. Split out of ``sample_batch``."""
    if outputs is None:
        return [SampleOutput([], [], "length") for _ in range(rows)]
    if len(outputs) != rows or any(o.token_ids or o.logprobs for o in outputs):
        raise ValueError("outputs must hold one empty SampleOutput per prompt")
    return outputs


def _pick_tokens(last: torch.Tensor, temps: torch.Tensor, greedy: torch.Tensor, generator: torch.Generator | None,
                 k_max: int, uniforms: list[float | None] | None = None,
                 ) -> tuple[torch.Tensor, list[int], list[float], tuple[list, list] | None]:
    """One decoding step's token per row (sampled, or the argmax for greedy rows), its logprob under
    ``logits / temperature``, and the ``k_max`` most likely (ids, logprobs) when asked for. A row with a
    value in ``uniforms`` is sampled by that draw (``call_seeds.token_at``: deterministic sampling), the
    others from ``generator``. Split out of ``sample_batch``."""
    logp = torch.log_softmax(last / temps, dim=-1)
    if uniforms is None or any(u is None for u in uniforms):
        sampled = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    else:
        sampled = torch.empty(logp.shape[0], dtype=torch.long, device=logp.device)
    for i, u in enumerate(uniforms or ()):
        if u is not None:
            sampled[i] = token_at(logp[i], u)
    tok = torch.where(greedy, logp.argmax(-1), sampled)
    tok_lp = logp.gather(-1, tok[:, None]).squeeze(-1)
    tok_l, lp_l = tok.tolist(), tok_lp.tolist()
    top = None
    if k_max:
        top_v, top_i = logp.topk(k_max, dim=-1)
        top = (top_i.tolist(), top_v.tolist())
    return tok, tok_l, lp_l, top


@dataclass(frozen=True)
class _RowRules:
    """Per row of a ``sample_batch``: its token limit, whether it ignores EOS, its top-k, and the stop
    tokens; ``record`` appends one step to the active rows and retires those that are done."""

    limits: list[int]
    keep_going: list[bool]  # ignore_eos
    top_k: list[int] | None
    stops: frozenset[int]

    def record(self, outs: list[SampleOutput], active: list[bool], tok_l: list[int], lp_l: list[float],
               top: tuple[list, list] | None) -> None:
        """Token id before logprob, so a reader never sees a logprob without its token (a generation cut)."""
        for i in range(len(outs)):
            if not active[i]:
                continue
            outs[i].token_ids.append(tok_l[i])
            outs[i].logprobs.append(lp_l[i])
            if self.top_k and self.top_k[i] > 0:
                top_i, top_v = top
                outs[i].top.append(list(zip(top_i[i][: self.top_k[i]], top_v[i][: self.top_k[i]])))
            if tok_l[i] in self.stops and not self.keep_going[i]:
                outs[i].finish_reason = "stop"
                active[i] = False
            elif len(outs[i].token_ids) >= self.limits[i]:
                active[i] = False


class HFPolicy:
    """A causal LM and its tokenizer; see the module docstring."""

    def __init__(self, model: Any, tokenizer: Any, max_seq_len: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.max_seq_len = min(int(max_seq_len), int(limit)) if max_seq_len else int(limit)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.stop_ids = stop_token_ids(tokenizer, model)
        self.pad_id = int(tokenizer.pad_token_id)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def parameters(self):
        return self.model.parameters()

    def train(self) -> "HFPolicy":
        self.model.train()
        return self

    def eval(self) -> "HFPolicy":
        self.model.eval()
        return self

    def _check_ids(self, ids: torch.Tensor, field: str) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"{field} contains token ids outside [0, {self.vocab_size})")
        if ids.shape[-1] > self.max_seq_len:
            raise ValueError(f"{field} is {ids.shape[-1]} tokens, over max_seq_len={self.max_seq_len}")

    # ----- scoring -------------------------------------------------------
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Right-padded ids [B, T] -> logits [B, T, V] (causal, so right padding never leaks back)."""
        return self.model(input_ids=ids, use_cache=False).logits

    def sequence_logprobs(self, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Right-padded ids [B, T] -> logprob of ids[:, 1:] given the prefix, [B, T-1]."""
        logits = self.logits(ids)[:, :-1].float()
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
        return self.sequence_logprobs(ids, temperature)[0, len(prompt_ids) - 1:].cpu()

    # ----- decoding ------------------------------------------------------
    @torch.no_grad()
    def sample_batch(self, prompts: list[list[int]], max_new_tokens: list[int], temperatures: list[float],
                     generator: torch.Generator | None = None,
                     top_k: list[int] | None = None,
                     between_steps: Callable[[], None] | None = None,
                     outputs: list[SampleOutput] | None = None,
                     ignore_eos: list[bool] | None = None,
                     draws: list[CallDraws | None] | None = None) -> list[SampleOutput]:
        """Decode several prompts at once (left padding, KV cache).

        A temperature <= 0 means greedy, scored at temperature 1. A row stops at
        a stop token (kept in its output) or at its own ``max_new_tokens``,
        capped so prompt + generation fits ``max_seq_len``. ``top_k[i]`` > 0 also
        records row i's most likely tokens at every step (same distribution).

        ``between_steps`` runs on this thread after each step that another
        forward follows (every active row has its new token, the next forward
        has not started): the one point where the weights may change in place
        (a refit) without touching the batch's KV cache or its outputs so far.

        ``outputs`` (one empty ``SampleOutput`` per prompt) are filled in place,
        token id before logprob, so another thread may read a row's tokens so far
        while it decodes (a generation cut): the first ``len(logprobs)`` token ids
        are always complete. ``ignore_eos[i]`` decodes row i to its limit, as
        vLLM's ``ignore_eos``. ``draws[i]`` (deterministic sampling,
        ``nemo_rl.models.generation.call_seeds``) samples row i's token t by a draw
        that depends only on the row's seed and t, not on ``generator``.
        """
        from transformers import DynamicCache

        B = len(prompts)
        lens, limits = self._generation_limits(prompts, max_new_tokens, temperatures)
        dev = self.device
        ids, attn = self._left_padded(prompts, lens, dev)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=positions, cache=cache,
                         use_cache=True, logits_to_keep=1)
        last = out.logits[:, -1].float()
        temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=dev)[:, None]
        greedy = torch.tensor([t <= 0 for t in temperatures], device=dev)
        next_pos = torch.tensor(lens, device=dev)
        outs = _empty_outputs(outputs, B)
        rows = _RowRules(limits, ignore_eos or [False] * B, top_k, self.stop_ids)
        active = [lim > 0 for lim in limits]
        k_max = min(max(top_k or [0]), self.vocab_size)
        while any(active):
            uniforms = None if draws is None else [
                None if d is None else d.u(len(o.token_ids)) for d, o in zip(draws, outs)]
            tok, tok_l, lp_l, top = _pick_tokens(last, temps, greedy, generator, k_max, uniforms)
            rows.record(outs, active, tok_l, lp_l, top)
            if not any(active):
                break
            if between_steps is not None:
                between_steps()
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=dev)], dim=1)
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                             cache=cache, use_cache=True)
            last = out.logits[:, -1].float()
            next_pos = next_pos + 1
        return outs

    def _generation_limits(self, prompts: list[list[int]], max_new_tokens: list[int],
                           temperatures: list[float]) -> tuple[list[int], list[int]]:
        """Each prompt's length and its generation limit (its ``max_new_tokens`` capped so prompt +
        generation fits ``max_seq_len``), refusing mismatched lists and empty or too-long prompts
        before anything runs. Split out of ``sample_batch``."""
        if not (len(prompts) == len(max_new_tokens) == len(temperatures)):
            raise ValueError("prompts, max_new_tokens and temperatures must have the same length")
        lens = [len(p) for p in prompts]
        for i, n in enumerate(lens):
            if n == 0:
                raise ValueError(f"prompt {i} is empty")
            if n >= self.max_seq_len:
                raise ValueError(f"prompt {i} is {n} tokens; max_seq_len={self.max_seq_len} leaves no room to generate")
        limits = [min(int(m), self.max_seq_len - n) for m, n in zip(max_new_tokens, lens)]
        return lens, limits

    def _left_padded(self, prompts: list[list[int]], lens: list[int],
                     dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts left-padded to one length (ids, attention mask) on ``dev``, ids checked, so every
        row's next token comes from the same last position. Split out of ``sample_batch``."""
        B, L = len(prompts), max(lens)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.as_tensor(p, dtype=torch.long)
            attn[i, L - len(p):] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        self._check_ids(ids, "prompt_ids")
        return ids, attn

    def decode_completion(self, token_ids: list[int]) -> str:
        """Reply text of generated ids (a trailing stop token dropped; tool-call tags kept)."""
        if token_ids and token_ids[-1] in self.stop_ids:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    # ----- weights -------------------------------------------------------
    def state_dict_cpu(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights do not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def load_policy(source: str, dtype: str, device: str, max_seq_len: int | None = None) -> HFPolicy:
    """``HFPolicy`` from a local model directory (see ``resolve_model_source`` for hub ids)."""
    dev = resolve_device(device)
    return HFPolicy(load_model(source, dtype, dev), load_tokenizer(source), max_seq_len)
