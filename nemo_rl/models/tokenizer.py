"""A small, deterministic word-piece tokenizer with a byte fallback.

Why our own: the policy is tiny and trained from scratch, so a vocabulary built
from the task data keeps sequences short, and a byte fallback means any text
round-trips exactly (``decode(encode(s)) == s``). The whole tokenizer is a JSON
document saved next to the weights, so a checkpoint is self-contained.

Layout of the id space (stable for a given JSON):

* ``0 .. len(SPECIAL_TOKENS)-1``: special tokens (chat roles, end of turn, call
  markers). Plain ``encode`` never produces them from text unless
  ``allow_special=True``; chat rendering inserts them by id.
* the next 256 ids: one token per byte value (the fallback).
* the rest: word pieces learned from a corpus (letters/underscore runs and
  single punctuation characters), most frequent first.

Text is split into pieces by ``PIECE_RE``: a run of ``[A-Za-z_]``, one digit,
one whitespace character, or one other character. Spaces are their own tokens
so a word has one id wherever it appears (in a user message or inside a JSON
argument), which makes copying names into tool calls easy to learn.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
    "<call>",
    "</call>",
)
NUM_BYTES = 256
PIECE_RE = re.compile(r"[A-Za-z_]+|[0-9]|\s|[^A-Za-z_0-9\s]")
_SPECIAL_SPLIT_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
TOKENIZER_FORMAT = "nemo_rl.word_byte_tokenizer.v1"


class Tokenizer:
    """Maps text to ids and back; see the module docstring for the id layout."""

    def __init__(self, pieces: Iterable[str] = ()):
        pieces = list(pieces)
        seen: set[str] = set()
        for p in pieces:
            if not isinstance(p, str) or not p:
                raise ValueError(f"tokenizer piece must be a non-empty string, got {p!r}")
            if p in seen:
                raise ValueError(f"tokenizer piece {p!r} is listed twice")
            if p in SPECIAL_TOKENS:
                raise ValueError(f"tokenizer piece {p!r} collides with a special token")
            if len(p.encode("utf-8")) == 1:
                raise ValueError(f"tokenizer piece {p!r} is a single byte; bytes are built in")
            seen.add(p)
        self._pieces = pieces
        self._piece_offset = len(SPECIAL_TOKENS) + NUM_BYTES
        self._piece_to_id = {p: self._piece_offset + i for i, p in enumerate(pieces)}
        self._special_to_id = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
        self._id_bytes: list[bytes] = (
            [t.encode("utf-8") for t in SPECIAL_TOKENS]
            + [bytes([b]) for b in range(NUM_BYTES)]
            + [p.encode("utf-8") for p in pieces]
        )

    # ----- construction -------------------------------------------------
    @classmethod
    def from_corpus(
        cls, texts: Iterable[str], max_pieces: int = 4000, min_count: int = 1
    ) -> "Tokenizer":
        """Learn word pieces from ``texts``; ties broken alphabetically so the result is deterministic."""
        if max_pieces < 0:
            raise ValueError(f"max_pieces must be >= 0, got {max_pieces}")
        counts: Counter[str] = Counter()
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"corpus entries must be str, got {type(text).__name__}")
            counts.update(p for p in PIECE_RE.findall(text) if len(p.encode("utf-8")) > 1)
        ranked = sorted(
            (p for p, c in counts.items() if c >= min_count and p not in SPECIAL_TOKENS),
            key=lambda p: (-counts[p], p),
        )
        return cls(ranked[:max_pieces])

    def to_dict(self) -> dict:
        return {"format": TOKENIZER_FORMAT, "special_tokens": list(SPECIAL_TOKENS), "pieces": list(self._pieces)}

    @classmethod
    def from_dict(cls, data: dict) -> "Tokenizer":
        if not isinstance(data, dict):
            raise ValueError(f"tokenizer JSON must be an object, got {type(data).__name__}")
        if data.get("format") != TOKENIZER_FORMAT:
            raise ValueError(f"tokenizer field 'format' must be {TOKENIZER_FORMAT!r}, got {data.get('format')!r}")
        if list(data.get("special_tokens", [])) != list(SPECIAL_TOKENS):
            raise ValueError("tokenizer field 'special_tokens' does not match this code's special tokens")
        pieces = data.get("pieces")
        if not isinstance(pieces, list):
            raise ValueError("tokenizer field 'pieces' must be a list of strings")
        return cls(pieces)

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=0))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        return cls.from_dict(json.loads(Path(path).read_text()))

    # ----- ids ----------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._id_bytes)

    def special_id(self, token: str) -> int:
        try:
            return self._special_to_id[token]
        except KeyError:
            raise KeyError(f"unknown special token {token!r}") from None

    pad_id = property(lambda self: self._special_to_id["<|pad|>"])
    bos_id = property(lambda self: self._special_to_id["<|bos|>"])
    eos_id = property(lambda self: self._special_to_id["<|eos|>"])
    end_id = property(lambda self: self._special_to_id["<|end|>"])
    call_open_id = property(lambda self: self._special_to_id["<call>"])
    call_close_id = property(lambda self: self._special_to_id["</call>"])

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < len(SPECIAL_TOKENS)

    # ----- encode / decode ---------------------------------------------
    def _encode_plain(self, text: str, out: list[int]) -> None:
        byte_base = len(SPECIAL_TOKENS)
        for piece in PIECE_RE.findall(text):
            pid = self._piece_to_id.get(piece)
            if pid is not None:
                out.append(pid)
            else:
                out.extend(byte_base + b for b in piece.encode("utf-8"))

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Text -> ids. With ``allow_special`` the literal special strings map to their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        out: list[int] = []
        if not allow_special:
            self._encode_plain(text, out)
            return out
        for part in _SPECIAL_SPLIT_RE.split(text):
            if part in self._special_to_id:
                out.append(self._special_to_id[part])
            elif part:
                self._encode_plain(part, out)
        return out

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        try:
            return b"".join(self._id_bytes[int(i)] for i in ids)
        except IndexError:
            bad = [int(i) for i in ids if not 0 <= int(i) < self.vocab_size]
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}") from None

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Ids -> text; bytes that do not form valid UTF-8 decode to U+FFFD."""
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if not self.is_special(i)]
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_str(self, token_id: int) -> str:
        """Display string for one token (used for OpenAI-style logprobs)."""
        raw = self._id_bytes[int(token_id)]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return f"<0x{raw[0]:02X}>"


def pieces_of(text: str) -> list[str]:
    """The pre-tokenization split (exposed for tests and corpus tools)."""
    return PIECE_RE.findall(text)
