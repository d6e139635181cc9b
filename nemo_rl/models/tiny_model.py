"""The embedded default model (``policy.model_name: tiny-causal-lm``), made locally.

No hub download: a byte-level BPE tokenizer is trained with ``tokenizers`` on
the task data, given a ChatML-style chat template whose tool calls are in the
hermes format (``<tool_call>{"name", "arguments"}</tool_call>``), and paired
with a randomly initialised Qwen3 (or Qwen2) model of ``policy.tiny_model``'s
size. Both are written with ``save_pretrained`` into a cache directory keyed by
the recipe (recipe settings + the training rows), so any ``transformers`` or
vLLM loader reads them.

The supervised warm start on the rows' demonstrations (run by
``nemo_rl.algorithms.embedded_model``) is cached the same way, keyed by the base
key and ``policy.warm_start``: its output directory is the default's
"pretrained model". A second run with the same recipe reuses both.

Cache layout (``<root>`` = ``policy.cache_dir``, ``$NEMO_RL_MODEL_CACHE`` or
``~/.cache/nemo_rl/models``)::

    <root>/tiny-causal-lm/<base_key>/base/            tokenizer + random init
    <root>/tiny-causal-lm/<base_key>/warm-<warm_key>/  after the warm start

Entries are written into a temporary sibling and renamed into place, so a
crash never leaves a half-written entry and concurrent builders agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from nemo_rl.models.policy_config import EMBEDDED_MODEL_NAME, PolicyConfig, TinyModelRecipe, WarmStartConfig

RECIPE_FORMAT = "nemo_rl.tiny_model.v1"
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, TOOL_OPEN, TOOL_CLOSE]
# Pre-tokenization: runs of letters/underscore, single digits, single whitespace
# characters, single other characters. A word is one token wherever it appears
# (sentence or JSON argument), which makes copying names into calls easy to learn.
PIECE_PATTERN = r"[A-Za-z_]+|[0-9]|\s|[^A-Za-z_0-9\s]"

# The tiny model's chat template (ChatML roles; tool names listed in the system
# turn to keep prompts short; assistant tool calls in the hermes format).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(first=0) -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set ns.first = 1 -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content -}}"
    "{%- if tools %}{{ '\\n' }}{% endif -%}"
    "{%- elif tools -%}{{- '<|im_start|>system\\n' -}}{%- endif -%}"
    "{%- if tools -%}{{- '<tools>' -}}"
    "{%- for t in tools -%}{{ t.function.name if t.function is defined else t.name }}"
    "{{ ' ' if not loop.last }}{%- endfor -%}{{- '</tools>' -}}{%- endif -%}"
    "{%- if ns.first == 1 or tools %}{{ '<|im_end|>\\n' }}{% endif -%}"
    "{%- for m in messages[ns.first:] -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}{%- if m.content %}{{ m.content }}{% endif -%}"
    "{%- for c in (m.tool_calls or []) -%}"
    "{%- if m.content or not loop.first %}{{ '\\n' }}{% endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (c.function.name | tojson) + ', \"arguments\": ' -}}"
    "{{- c.function.arguments if c.function.arguments is string else (c.function.arguments | tojson) -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)


def cache_root(policy_cfg: PolicyConfig) -> Path:
    if policy_cfg.cache_dir:
        return Path(policy_cfg.cache_dir).expanduser()
    env = os.environ.get("NEMO_RL_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nemo_rl" / "models"


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def base_key(recipe: TinyModelRecipe, rows: list[dict]) -> str:
    return _digest({"format": RECIPE_FORMAT, "recipe": recipe.model_dump(mode="json"), "rows": _digest(rows),
                    "template": CHAT_TEMPLATE, "pieces": PIECE_PATTERN})


def warm_key(ws: WarmStartConfig, seed: int) -> str:
    return _digest({"warm_start": ws.model_dump(mode="json"), "seed": seed})


# ----- tokenizer -------------------------------------------------------------
def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with the chat and tool-call special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PIECE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(list(texts), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=IM_END, pad_token=PAD,
                                  additional_special_tokens=[IM_START, TOOL_OPEN, TOOL_CLOSE],
                                  clean_up_tokenization_spaces=False, model_max_length=1 << 20)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tokenizer_corpus(rows: list[dict], conversations: list[list[dict]]) -> list[str]:
    """Every string the tokenizer should know: messages, call names, arguments, the call JSON, roles."""
    from nemo_rl.models.chat import format_tool_call

    texts = ["system user assistant tool tools name arguments"] * 4 + ['{"name": "x", "arguments": {}}']
    for conv in conversations:
        for m in conv:
            if isinstance(m.get("content"), str):
                texts.append(m["content"])
            for c in m.get("tool_calls") or []:
                texts += [c["function"]["name"], c["function"]["arguments"],
                          format_tool_call(c["function"]["name"], c["function"]["arguments"])]
    for row in rows:
        for tool in row["responses_create_params"].get("tools") or []:
            texts.append(tool.get("name") or tool.get("function", {}).get("name", ""))
    return texts


# ----- model -----------------------------------------------------------------
def model_config(recipe: TinyModelRecipe, tokenizer: Any) -> Any:
    from transformers import Qwen2Config, Qwen3Config

    cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config}[recipe.architecture]
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    return cls(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers, num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads, head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
    )


def init_model(recipe: TinyModelRecipe, tokenizer: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = model_config(recipe, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.init_seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
                                               bos_token_id=cfg.bos_token_id)
    return model


def _publish(tmp: Path, final: Path) -> Path:
    """Rename a finished temp dir into place; if another builder won, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if (final / "config.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise
    return final


def _tmp_dir(final: Path) -> Path:
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp


def _complete(path: Path) -> bool:
    return (path / "recipe.json").is_file()


def ensure_base(policy_cfg: PolicyConfig, rows: list[dict], log: Callable[[str], None] = print, *,
                conversations: list[list[dict]]) -> Path:
    """The cached tokenizer + random init for this recipe; built (seconds) if missing. ``conversations``:
    the rows' demonstrations (``nemo_rl.algorithms.warm_start.simulate_rows``), part of the tokenizer's
    corpus."""
    recipe = policy_cfg.tiny_model
    final = cache_root(policy_cfg) / EMBEDDED_MODEL_NAME / base_key(recipe, rows) / "base"
    if _complete(final):
        log(f"Embedded model: reusing the cached tokenizer and initial weights in {final}")
        return final
    t0 = time.perf_counter()
    tok = train_tokenizer(tokenizer_corpus(rows, conversations), recipe.vocab_size)
    model = init_model(recipe, tok)
    tmp = _tmp_dir(final)
    tok.save_pretrained(tmp)
    model.save_pretrained(tmp)
    (tmp / "recipe.json").write_text(json.dumps(
        {"format": RECIPE_FORMAT, "tiny_model": recipe.model_dump(mode="json"), "rows": len(rows)}, indent=1))
    _publish(tmp, final)
    log(f"Embedded model: trained a {len(tok)}-token tokenizer and initialised a {recipe.architecture} model "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters) in {time.perf_counter() - t0:.1f}s; "
        f"cached in {final}")
    return final


def warm_dir(policy_cfg: PolicyConfig, rows: list[dict], seed: int) -> Path:
    """Where the warm start of this recipe, rows, ``policy.warm_start`` and seed is cached."""
    root = cache_root(policy_cfg) / EMBEDDED_MODEL_NAME / base_key(policy_cfg.tiny_model, rows)
    return root / f"warm-{warm_key(policy_cfg.warm_start, seed)}"


def is_cached(entry: Path) -> bool:
    """A finished cache entry (a crashed build leaves only a temporary sibling)."""
    return _complete(entry)


def save_warm(policy: Any, final: Path, policy_cfg: PolicyConfig, seed: int, metrics: dict) -> Path:
    """Write a warm-started policy (model + tokenizer + its recipe) into the cache at ``final``."""
    tmp = _tmp_dir(final)
    policy.model.save_pretrained(tmp)
    policy.tokenizer.save_pretrained(tmp)
    (tmp / "recipe.json").write_text(json.dumps(
        {"format": RECIPE_FORMAT, "tiny_model": policy_cfg.tiny_model.model_dump(mode="json"),
         "warm_start": policy_cfg.warm_start.model_dump(mode="json"), "seed": seed, "metrics": metrics}, indent=1))
    return _publish(tmp, final)
