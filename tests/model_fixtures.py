"""Small Hugging Face models built on the spot for tests (no hub access).

``tiny_qwen_dir``: the embedded recipe's tokenizer and model class at test size.
``llama_dir``: another architecture (Llama) with its own tokenizer, special
tokens and chat template (Llama-3-like headers, hermes tool calls), saved with
``save_pretrained`` like any downloaded model.
"""

from __future__ import annotations

import json
from pathlib import Path

from nemo_rl.algorithms.grpo_config import TinyModelRecipe
from nemo_rl.models.tiny_model import init_model, train_tokenizer

CORPUS = [
    "Use the tools to do the task, then say Done.",
    "Invite bo to a meeting called sync on 2023-12-04 at 10:00",
    '{"name": "directory_find_email", "arguments": {"name": "bo"}}',
    "bo@corp.com alpha beta gamma delta Done. system user assistant tool",
    "Created event E2.",
]
SMALL = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32,
             max_position_embeddings=512)


def tiny_qwen_dir(path: Path, corpus: list[str] = CORPUS, **recipe) -> Path:
    rec = TinyModelRecipe(**{**SMALL, **recipe})
    tok = train_tokenizer(corpus, 400)
    model = init_model(rec, tok)
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(path)
    model.save_pretrained(path)
    return path


LLAMA_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- if tools -%}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools: ' -}}"
    "{{- tools | map(attribute='function') | map(attribute='name') | join(', ') -}}{{- '<|eot_id|>' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' -}}"
    "{%- if m.content %}{{ m.content }}{% endif -%}"
    "{%- for c in (m.tool_calls or []) -%}"
    "{{- '<tool_call>' + ({'name': c.function.name, 'arguments': c.function.arguments} | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif -%}"
)


def llama_dir(path: Path, rows: list[dict] | None = None) -> Path:
    """A random Llama with a WordPiece-free byte-level BPE tokenizer of its own, saved for from_pretrained."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|pad|>",
                "<tool_call>", "</tool_call>"]
    texts = list(CORPUS)
    for r in rows or []:
        texts.append(json.dumps(r, ensure_ascii=False))
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                  pad_token="<|pad|>", additional_special_tokens=specials[2:4] + specials[5:])
    tok.chat_template = LLAMA_TEMPLATE
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=eot, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=eot, bos_token_id=tok.bos_token_id,
                                               pad_token_id=tok.pad_token_id)
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(path)
    model.save_pretrained(path)
    return path
