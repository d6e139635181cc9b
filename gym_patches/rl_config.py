"""The Gym section of a NeMo-RL training config, read without importing NeMo-RL.

The Gym launcher (``python -m gym_patches.launch --config <rl yaml> [key=value ...]``) starts the
Gym servers a training run with that config would start (docs/design.md §4.2). The RL side's rules
are restated here so that Gym needs none of RL's code; ``tests/unit/test_launch_rl_config.py``
compares the two on every shipped config:

- the YAML and its ``defaults:`` parents (relative to the file; merged with OmegaConf: mappings
  merge, lists are replaced), then ``key=value`` / ``+key=value`` / ``++key=value`` overrides;
- the Gym section is ``env.nemo_gym``: its ``config_paths`` then ``config``, then each shard's own
  ``config_paths`` and ``config``, merged in that order (mappings merge, anything else is replaced);
  a shard runs ``replicas`` deployments (``<shard>/replica-<i>``); a file path is relative to the
  current directory, else to the repository root (where the shipped examples are);
- each replica's head server listens on loopback on a free port; checkpoints are enabled when
  ``rollout_recovery.target_level`` is ``turn`` or ``prefix``; the control token is made here (a run
  makes its own), and the policy URL is what the Gym config says (a run points it at its policy).
"""

from __future__ import annotations

import copy
import difflib
import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from pydantic import ValidationError

from gym_patches.checkpoint.storage import StorageWriterSpec
from gym_patches.config import SERVER_KIND, GymConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
# Top-level keys of a NeMo-RL training config (a Gym config has none of them).
RL_KEYS = ("grpo", "policy", "data", "env", "rollout_recovery", "rollout_checkpointing", "checkpointing",
           "defaults", "logger", "cluster", "async_rl")
GYM_SECTION = "env.nemo_gym"
SECTION_KEYS = ("config_paths", "config", "shards", "spinup_timeout_s")
SHARD_KEYS = ("name", "replicas", "config_paths", "config", "ray_resources")
DEFAULT_SHARD = "nemo_gym"
DEFAULT_SPINUP_TIMEOUT_S = 120.0
LEVELS = ("prefix", "turn", "sibling", "prompt_group")
CHECKPOINTED_LEVELS = ("prefix", "turn")
DEFAULT_LEVEL = "sibling"
DEFAULT_LEASE_GRACE_S = 600.0


@dataclass(frozen=True)
class GymInstance:
    """One replica of one shard: the Gym config it runs."""

    instance_id: str  # "<shard>/replica-<i>"
    config: dict[str, Any]


@dataclass(frozen=True)
class RlGym:
    """What an RL config asks of Gym."""

    source: str  # the file(s) and overrides, for messages
    target_level: str
    checkpointing: bool
    spinup_timeout_s: float
    instances: list[GymInstance]
    control_token: str  # every instance's checkpoint control token (a run makes its own)


def looks_like_rl_config(paths: list[str]) -> bool:
    """Whether the first file (as given, else under the repository root) has a NeMo-RL top-level key;
    an unreadable one is left to the Gym loader to name."""
    try:
        data = yaml.safe_load(_resolve_config_path(paths[0]).read_text())
    except (GymConfigError, OSError, yaml.YAMLError):
        return False
    if not isinstance(data, dict):
        return False
    # A Gym server may be named like an RL section ("policy"): its value names a server type.
    return any(k in data and not (isinstance(data[k], dict) and set(data[k]) & set(SERVER_KIND)) for k in RL_KEYS)


def _read(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in chain:
        raise GymConfigError(f"{path}: 'defaults' inheritance cycle: {' -> '.join(map(str, chain + (path,)))}")
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise GymConfigError(f"{path}: cannot read config ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise GymConfigError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise GymConfigError(f"{path}: an RL config must be a mapping of sections (env:, grpo:, ...)")
    parents = data.pop("defaults", None)
    if parents is None:
        return data
    parents = [parents] if isinstance(parents, str) else parents
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise GymConfigError(f"{path}: 'defaults' must be a file name or a list of file names")
    merged = OmegaConf.create({})
    for parent in parents:
        merged = OmegaConf.merge(merged, _read(path.parent / parent, chain + (path,)))
    return OmegaConf.to_container(OmegaConf.merge(merged, data), resolve=False)


def _resolve_config_path(path: str) -> Path:
    given = Path(path).expanduser()
    if given.is_absolute() or given.exists():
        return given
    if (REPO_ROOT / given).exists():
        return REPO_ROOT / given
    raise GymConfigError(f"--config {path}: no such file ({Path.cwd() / given}, nor {REPO_ROOT / given} "
                         "under the repository root)")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``key.path=value`` (value parsed as YAML; a ``+`` / ``++`` prefix is accepted as the RL entry
    point's). Keys outside the Gym section and ``rollout_recovery.target_level`` do not change what
    Gym starts and are not checked here (``run_grpo.py --check`` checks the whole config)."""
    data = copy.deepcopy(data)
    for text in overrides:
        key, sep, raw = text.lstrip("+").partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise GymConfigError(f"override {text!r} must look like key.path=value")
        value = yaml.safe_load(raw) if raw else ""
        node: Any = data
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            if isinstance(node, list):
                if not (part.isdigit() and int(part) < len(node)):
                    raise GymConfigError(f"override {text!r}: {'.'.join(parts[:depth])} has no item {part}")
                index: Any = int(part)
            elif isinstance(node, dict):
                index = part
                if not last and not isinstance(node.get(part), (dict, list)):
                    node[part] = {}
            else:
                raise GymConfigError(f"override {text!r}: '{'.'.join(parts[:depth])}' is not a mapping")
            if last:
                node[index] = value
            else:
                node = node[index]
    return data


def _unknown(keys: Any, known: tuple[str, ...], where: str) -> None:
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"did you mean '{where}.{close[0]}'?" if close else f"{where} has only {', '.join(known)}"
            raise GymConfigError(f"{where}.{key}: unknown key ({hint})")


def _mapping(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise GymConfigError(f"{key} must be a mapping, got {type(value).__name__}")
    return value


def _paths(value: Any, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise GymConfigError(f"{key} must be a list of file paths")
    return value


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else copy.deepcopy(value)
    return out


def _gym_file(key: str, path: str) -> dict[str, Any]:
    given = Path(path).expanduser()
    candidates = [given] if given.is_absolute() else [Path.cwd() / given, REPO_ROOT / given]
    found = next((p for p in candidates if p.exists()), None)
    if found is None:
        raise GymConfigError(f"{key}={path}: no such file ({' nor '.join(map(str, candidates))})")
    try:
        data = yaml.safe_load(found.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise GymConfigError(f"{key}={path}: cannot read it as YAML ({exc})") from None
    if not isinstance(data, dict):
        raise GymConfigError(f"{key}={path}: a Gym config must hold a mapping")
    return data


def _checkpoint_block(block: Any, token: str, enabled: bool, writer: dict[str, Any] | None) -> dict[str, Any]:
    """RL's checkpoint block: only ``lease_grace_seconds`` is the user's; RL sets the rest (the storage
    writer from ``checkpointing.storage_writer``)."""
    block = _mapping(block, f"{GYM_SECTION} Gym key 'checkpoint'")
    _unknown(block, ("lease_grace_seconds", "enabled", "control_auth_token"), "checkpoint")
    grace = block.get("lease_grace_seconds", DEFAULT_LEASE_GRACE_S)
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not math.isfinite(grace) or grace <= 0:
        raise GymConfigError(f"Gym config key checkpoint.lease_grace_seconds must be a positive number of "
                             f"seconds, got {grace!r}")
    out = {"enabled": enabled, "control_auth_token": token, "lease_grace_seconds": float(grace)}
    if writer is not None:
        out["storage_writer"] = writer
    return out


def _storage_writer(data: dict[str, Any]) -> dict[str, Any] | None:
    """``checkpointing.storage_writer`` as every Gym server of the run gets it (None: plain files)."""
    spec = _mapping(data.get("checkpointing"), "checkpointing").get("storage_writer")
    if spec is None:
        return None
    try:
        return StorageWriterSpec.model_validate(spec).model_dump(mode="json")
    except ValidationError as exc:
        raise GymConfigError(f"checkpointing.storage_writer: {exc.errors()[0]['msg']}") from None


def shard_configs(data: dict[str, Any]) -> list[tuple[str, int, dict[str, Any]]]:
    """``(shard name, replicas, merged Gym config)`` per shard of ``env.nemo_gym`` (nothing injected)."""
    env = _mapping(data.get("env"), "env")
    section = _mapping(env.get("nemo_gym"), GYM_SECTION)
    _unknown(section, SECTION_KEYS, GYM_SECTION)
    shards = section.get("shards", [{}])
    if not isinstance(shards, list) or not shards:
        raise GymConfigError(f"{GYM_SECTION}.shards must be a non-empty list of shards")
    common: dict[str, Any] = {}
    for j, path in enumerate(_paths(section.get("config_paths"), f"{GYM_SECTION}.config_paths")):
        common = _merge(common, _gym_file(f"{GYM_SECTION}.config_paths.{j}", path))
    common = _merge(common, _mapping(section.get("config"), f"{GYM_SECTION}.config"))
    out, names = [], set()
    for i, shard in enumerate(shards):
        where = f"{GYM_SECTION}.shards.{i}"
        shard = _mapping(shard, where)
        _unknown(shard, SHARD_KEYS, where)
        name, replicas = shard.get("name", DEFAULT_SHARD), shard.get("replicas", 1)
        if name in names:
            raise GymConfigError(f"{where}.name: shard {name!r} is named twice")
        names.add(name)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise GymConfigError(f"{where}.replicas must be a whole number >= 1, got {replicas!r}")
        merged = common
        for j, path in enumerate(_paths(shard.get("config_paths"), f"{where}.config_paths")):
            merged = _merge(merged, _gym_file(f"{where}.config_paths.{j}", path))
        out.append((name, replicas, _merge(merged, _mapping(shard.get("config"), f"{where}.config"))))
    return out


def read_rl_gym(paths: list[str], overrides: list[str] | None = None) -> RlGym:
    """The Gym deployments the RL config at ``paths[0]`` (plus ``overrides``) would start, each
    replica's config as the run would give it (docs/design.md §4.2)."""
    if len(paths) != 1:
        raise GymConfigError(f"an RL config is one file (got {len(paths)}: {', '.join(paths)}); "
                             "change it with key=value overrides")
    data = apply_overrides(_read(_resolve_config_path(paths[0])), overrides or [])
    recovery = _mapping(data.get("rollout_recovery"), "rollout_recovery")
    level = recovery.get("target_level", DEFAULT_LEVEL)
    if level not in LEVELS:
        raise GymConfigError(f"rollout_recovery.target_level={level!r}: must be one of {', '.join(LEVELS)}")
    section = _mapping(_mapping(data.get("env"), "env").get("nemo_gym"), GYM_SECTION)
    timeout = section.get("spinup_timeout_s", DEFAULT_SPINUP_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise GymConfigError(f"{GYM_SECTION}.spinup_timeout_s must be a positive number, got {timeout!r}")
    checkpointing = level in CHECKPOINTED_LEVELS
    token = secrets.token_urlsafe(24)
    instances = []
    writer = _storage_writer(data)
    for name, replicas, gym in shard_configs(data):
        cfg = dict(gym)
        cfg["head_server"] = {"host": "127.0.0.1", "port": 0}
        cfg["checkpoint"] = _checkpoint_block(gym.get("checkpoint"), token, checkpointing, writer)
        instances += [GymInstance(f"{name}/replica-{i}", copy.deepcopy(cfg)) for i in range(replicas)]
    source = paths[0] + (f" + {len(overrides)} override(s)" if overrides else "")
    return RlGym(source, level, checkpointing, float(timeout), instances, token)
