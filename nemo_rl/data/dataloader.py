"""Deterministic prompt order with a resumable position.

Epoch ``e`` visits every row once in an order fixed by ``seed + e``; the whole
state is one integer, so a snapshot or trainer checkpoint stores it exactly.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"data file {path} cannot be read: {exc.strerror or exc}") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None
        if not isinstance(row, dict) or "responses_create_params" not in row:
            raise ValueError(f"{path}:{lineno}: a Gym row needs 'responses_create_params'")
        rows.append(row)
    if not rows:
        raise ValueError(f"data file {path} holds no rows")
    return rows


class PromptDataloader:
    def __init__(self, rows: list[dict[str, Any]], *, seed: int, shuffle: bool = True):
        if not rows:
            raise ValueError("PromptDataloader needs at least one row")
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def next_index(self) -> int:
        epoch, offset = divmod(self.position, len(self.rows))
        self.position += 1
        return self._order(epoch)[offset]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "num_rows": len(self.rows), "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("num_rows") != len(self.rows) or state.get("seed") != self.seed:
            raise ValueError(
                f"dataloader state was saved for {state.get('num_rows')} rows / seed {state.get('seed')}, "
                f"but data has {len(self.rows)} rows / seed {self.seed} (data.train_data_path or data.seed changed?)"
            )
        self.position = int(state["position"])
