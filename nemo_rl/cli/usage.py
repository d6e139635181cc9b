"""The text of ``run_grpo --help``: the shipped configs and the recovery and async keys.

Generated on each call from ``examples/configs/*.yaml`` (each file's first
comment line) and from the config schema's fields and defaults
(``single_controller_utils/config.py``), so it cannot drift from either
(docs/design.md §5.1).
"""

from __future__ import annotations

import enum
import textwrap
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from nemo_rl.algorithms.single_controller_utils.config import REPO_ROOT, MasterConfig

DESCRIPTION = """GRPO with turn-level rollout recovery.

With no arguments it runs the embedded default: local Ray, Gym servers on
loopback, the tiny CPU policy, the Workplace setup with turn recovery. Running
the same command again after a crash resumes from the newest checkpoint.

Overrides are Hydra-style: key.path=value sets a key the config or the schema
has, ++key.path=value adds one inside a free-form mapping (env.nemo_gym.config),
+key.path=value adds one that must not exist yet. Relative paths (--config,
data paths, model directories, Gym config files) are taken from the current
directory, else from the repository root."""

# The sections listed with every key and default: recovery, snapshots, and upstream's async_rl.
LISTED_SECTIONS = ("rollout_recovery", "rollout_checkpointing", "async_rl")


def summary_line(text: str) -> str:
    """The first sentence of a file's leading comment block (its first comment line if it has no period)."""
    block = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        block.append(line.lstrip("#").strip())
    if not block:
        return ""
    joined = " ".join(part for part in block if part)
    end = joined.find(". ")
    sentence = joined[: end + 1] if end >= 0 else joined
    return sentence if sentence.endswith(".") and len(sentence) <= 200 else block[0]


def shipped_configs(root: Path = REPO_ROOT) -> list[tuple[str, str]]:
    """``(path relative to the repository, its summary line)`` for each ``examples/configs/*.yaml``."""
    return [(path.relative_to(root).as_posix(), summary_line(path.read_text()))
            for path in sorted((root / "examples" / "configs").glob("*.yaml"))]


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(str(a) for a in get_args(annotation))
    if origin is Union or type(annotation).__name__ == "UnionType":
        return " | ".join("null" if a is type(None) else _type_name(a) for a in get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(str(m.value) for m in annotation)
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    return getattr(annotation, "__name__", str(annotation))


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if value != {} else "{}"


def schema_keys(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str]]:
    """``(dotted key, default, type)`` for every leaf field of ``model``, nested sections expanded."""
    defaults = model()
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}"
        value = getattr(defaults, name)
        if isinstance(value, BaseModel):
            rows += schema_keys(type(value), key)
        else:
            rows.append((key, _shown(value), _type_name(field.annotation)))
    return rows


def epilog() -> str:
    lines = ["shipped configs (--config FILE.yaml):"]
    for path, first in shipped_configs():
        lines.append(f"  {path}")
        lines.append(textwrap.fill(first, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    for section in LISTED_SECTIONS:
        model = MasterConfig.model_fields[section].annotation
        lines += ["", f"{section} keys (default, type):"]
        for key, default, kind in schema_keys(model, section):
            lines.append(f"  {key} = {default}  ({kind})")
    lines += [
        "",
        "other sections: grpo, loss_fn, policy, data, env, logger, checkpointing, cluster (a typo'd key is",
        "an error suggesting the nearest one).",
        "",
        "examples:",
        "  run_grpo.py --config examples/configs/grpo_workplace_turn.yaml grpo.max_num_steps=5",
        "  run_grpo.py --config examples/configs/grpo_mixed_turn.yaml --check",
        "  python -m nemo_rl.cli.inspect results/grpo    # what a restart would restore, starting nothing",
    ]
    return "\n".join(lines)
