"""The run config: YAML files with ``defaults:`` inheritance and Hydra-style overrides.

Every section forbids unknown keys, so a typo fails at startup with the full
dotted path of the bad key instead of silently keeping a default. The recovery
section also rejects settings that cannot work together, e.g. accepting
restart-only Gym servers at a level that never asks Gym to save (docs/design.md §5.1).
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from omegaconf import OmegaConf
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gym_patches.checkpoint.storage import StorageWriterSpec
from nemo_rl.algorithms.grpo_config import GRPOConfig, LossConfig, PolicyConfig
from nemo_rl.experience.rollout_recovery import RecoveryTargetLevel

DEFAULT_GYM_SHARD = "nemo_gym"
REPO_ROOT = Path(__file__).resolve().parents[3]  # the shipped examples' paths fall back to it
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Keys renamed to upstream NeMo-RL's names: a config (or an override) that still uses one gets this.
_RENAMED_KEYS = {
    "checkpointing.keep_latest_k": "checkpointing.keep_latest_k was renamed checkpointing.keep_top_k "
                                   "(with metric_name: null it keeps the latest k)",
}
# Keys an older recovery config used; they name what replaced them.
_REMOVED_RECOVERY_KEYS = (
    "default_granularity",
    "task_granularity_overrides",
    "task_source_granularity_overrides",
    "agent_granularity_overrides",
    "preserve_generation_prefixes",
    "generation_chunk_flush_tokens",
)


class ConfigError(ValueError):
    """A config that cannot be used; the message names each bad key by dotted path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----- sections ------------------------------------------------------------
SCRIPTED_TEST_BACKEND = "scripted-test-backend"


class ScriptedBackendConfig(_Section):
    """``policy.scripted_backend``: how the named fake ``policy.model_name: scripted-test-backend``
    replies (``gym_patches/fakes/scripted_backend.py``); each reply waits ``delay_s`` plus up to
    ``jitter_s`` more (seeded) and, with ``tokens_per_s`` set, for a stand-in generation device that
    decodes that many fake tokens per second shared by the replies in flight (a reply of k tokens
    alone: k / ``tokens_per_s``), sleeping, not computing; ``max_num_seqs`` bounds the replies it works
    on at once, as a server's batch does (the rest wait their turn). Only that fake reads it."""

    delay_s: float = Field(default=0.0, ge=0.0, le=600.0)  # the fake's own bounds
    jitter_s: float = Field(default=0.0, ge=0.0, le=600.0)
    tokens_per_s: float | None = Field(default=None, gt=0.0, le=1e9)  # None: a reply's length costs no time
    # At most this many replies are worked on at once, the rest wait their turn, as a server's batch
    # (vLLM's max_num_seqs) bounds it; None: no bound.
    max_num_seqs: int | None = Field(default=None, ge=1, le=1_000_000)


class SimulatedTrainerConfig(_Section):
    """``policy.simulated_trainer``: with the scripted backend, a trainer stand-in instead of the plain
    recording trainer: it records the same batches and sleeps ``seconds_per_sample`` per sample it is
    given (no model, no gradients, no CPU), so training has its own wall-clock timeline in throughput
    benchmarks (docs/benchmarks.md, "Async on simulated devices"). None: no stand-in."""

    seconds_per_sample: float | None = Field(default=None, gt=0.0, le=600.0)


class RunPolicyConfig(PolicyConfig):
    """The run's ``policy`` section: the trainer's ``PolicyConfig`` plus the scripted fake's replies
    and its trainer stand-in."""

    scripted_backend: ScriptedBackendConfig = Field(default_factory=ScriptedBackendConfig)
    simulated_trainer: SimulatedTrainerConfig = Field(default_factory=SimulatedTrainerConfig)

    @model_validator(mode="after")
    def _scripted_only(self) -> "RunPolicyConfig":
        for key, value, default in (("scripted_backend", self.scripted_backend, ScriptedBackendConfig()),
                                    ("simulated_trainer", self.simulated_trainer, SimulatedTrainerConfig())):
            if value != default and self.model_name != SCRIPTED_TEST_BACKEND:
                raise ValueError(
                    f"policy.{key} is set but policy.model_name={self.model_name!r}; it configures "
                    f"only policy.model_name={SCRIPTED_TEST_BACKEND}")
        return self

    def trainer_policy(self) -> PolicyConfig:
        """The section without the fake's keys: what the trainer and the generation workers validate."""
        return PolicyConfig.model_validate(self.model_dump(exclude={"scripted_backend", "simulated_trainer"}))


class DataConfig(_Section):
    train_data_path: str
    val_data_path: str | None = None
    shuffle: bool = True
    seed: int = 42


class ShardConfig(_Section):
    """One Gym deployment shape, started ``replicas`` times (``<name>/replica-<i>``)."""

    name: str = DEFAULT_GYM_SHARD
    replicas: int = Field(default=1, ge=1)
    config_paths: list[str] = Field(default_factory=list)  # laid over the common ones
    config: dict[str, Any] = Field(default_factory=dict)  # inline Gym YAML, laid over last
    # Ray custom resources each replica's actor asks for: places the shard on the nodes that offer
    # them (``ray start --resources='{"gym_a": 4}'``); empty: anywhere.
    ray_resources: dict[str, float] = Field(default_factory=dict)

    @field_validator("ray_resources")
    @classmethod
    def _positive(cls, value: dict[str, float]) -> dict[str, float]:
        bad = sorted(k for k, v in value.items() if not v > 0)
        if bad:
            raise ValueError(f"ray_resources {bad} must ask for a positive amount")
        return value

    @field_validator("name")
    @classmethod
    def _safe(cls, value: str) -> str:
        if not _SAFE_NAME.match(value):
            raise ValueError(f"shard name {value!r} must match {_SAFE_NAME.pattern}")
        return value


class NemoGymEnvConfig(_Section):
    """Gym deployment: common config (paths then inline dict) plus per-shard overlays.

    The Gym YAML (server instance names plus global keys) is carried, not
    interpreted, here.
    """

    config_paths: list[str] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)
    shards: list[ShardConfig] = Field(default_factory=lambda: [ShardConfig()], min_length=1)
    spinup_timeout_s: float = Field(default=120.0, gt=0)

    @field_validator("shards")
    @classmethod
    def _unique(cls, shards: list[ShardConfig]) -> list[ShardConfig]:
        names = [s.name for s in shards]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"shard names must be unique, repeated: {dupes}")
        return shards

    def instance_ids(self) -> list[str]:
        """Every replica's checkpoint instance id, ``<shard>/replica-<i>``."""
        return [f"{s.name}/replica-{i}" for s in self.shards for i in range(s.replicas)]


class EnvConfig(_Section):
    # Upstream's switch between Gym and its own environments; here Gym is the only path, so an
    # upstream YAML that says true loads unchanged and false is refused instead of silently ignored.
    should_use_nemo_gym: bool = True
    nemo_gym: NemoGymEnvConfig = Field(default_factory=NemoGymEnvConfig)

    @field_validator("should_use_nemo_gym")
    @classmethod
    def _gym_only(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                "env.should_use_nemo_gym=false is not supported: this project runs every rollout in Gym "
                "(env.nemo_gym); remove the key or set it to true"
            )
        return value


class TensorBoardLoggerConfig(_Section):
    # event files, relative to logger.log_dir unless absolute
    log_dir: str = "tensorboard"


class WandbLoggerConfig(_Section):
    project: str = "nemo-rl"
    name: str | None = None  # the run's name; None: W&B picks one


class MlflowLoggerConfig(_Section):
    experiment_name: str = "nemo-rl"
    run_name: str | None = None
    # None: a SQLite store in logger.log_dir/mlruns (MLflow 3 refuses its plain-file store by default)
    tracking_uri: str | None = None


def _empty_section(value: Any) -> Any:
    """``tensorboard:`` with nothing after it (YAML null) means the defaults, like ``tensorboard: {}``."""
    return {} if value is None else value


class LoggerConfig(_Section):
    log_dir: str = "logs/grpo"
    metrics_file: str = "metrics.jsonl"  # per-step metrics, relative to log_dir
    # Views of the same records (metrics.jsonl stays the always-on one), each from its own extra:
    # pip install '.[tensorboard]' / '.[wandb]' / '.[mlflow]'. Series names: nemo_rl/utils/loggers/names.py.
    tensorboard_enabled: bool = False
    wandb_enabled: bool = False  # WANDB_MODE=offline keeps the run under log_dir/wandb
    mlflow_enabled: bool = False
    tensorboard: TensorBoardLoggerConfig = Field(default_factory=TensorBoardLoggerConfig)
    wandb: WandbLoggerConfig = Field(default_factory=WandbLoggerConfig)
    mlflow: MlflowLoggerConfig = Field(default_factory=MlflowLoggerConfig)

    _sections_may_be_empty = field_validator("tensorboard", "wandb", "mlflow", mode="before")(_empty_section)

    @field_validator("metrics_file")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not value or "/" in value or value in (".", ".."):
            raise ValueError(f"logger.metrics_file must be a file name inside logger.log_dir, got {value!r}")
        return value
    progress_bar: bool = True
    plot: bool = True


class CheckpointingConfig(_Section):
    # false: no trainer checkpoints, no restore, no rollout snapshots (every start is a new run)
    enabled: bool = True
    checkpoint_dir: str = "results/grpo"
    save_period: int = Field(default=1, ge=1)
    # Trainer steps kept on disk (each with its rollout snapshots); null keeps every step. Upstream's
    # name: with metric_name null it keeps the latest k, the only ranking this controller has.
    keep_top_k: int | None = Field(default=3, ge=1)
    metric_name: str | None = None
    # Resume even if checkpoint_dir was written by a run with other data, model, group size or Gym topology.
    allow_different_run: bool = False
    # The StorageWriter every checkpoint file of the run goes through, in the driver and in each Gym
    # server: {class_path: "package.module:ClassName", kwargs: {...}}; null writes plain files
    # (docs/design.md §4.7).
    storage_writer: StorageWriterSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "keep_latest_k" in data:
            raise ValueError(_RENAMED_KEYS["checkpointing.keep_latest_k"])
        return data

    @field_validator("metric_name")
    @classmethod
    def _latest_only(cls, value: str | None) -> str | None:
        # Ranking steps by a metric would need validation scores kept per step; nothing here records them.
        if value is not None:
            raise ValueError(
                f"checkpointing.metric_name={value!r} is not supported: only null (keep the latest k) is "
                "supported by this controller"
            )
        return value


class ClusterConfig(_Section):
    ray_address: str | None = None  # None: start a local Ray
    num_cpus: int | None = Field(default=None, ge=1)
    gpus_per_node: int = Field(default=0, ge=0)


class InRunRecoveryConfig(_Section):
    """A Gym server or replica, or the generation worker, lost mid-run is recovered inside the run (docs/design.md
    §5.12); the same bounds apply to each replica and to the worker."""

    enabled: bool = True  # false: its rollouts fail as infrastructure errors and a lost replica stops the run
    # A replica (or the worker) started this many times within ``window_s`` (each recovery, and each start that
    # did not come up) is given up at its next loss: a replica's rollouts move to the shard's other replicas, or,
    # with none left (or for the worker), the run stops naming the server or worker and its log.
    max_recoveries: int = Field(default=3, ge=1)
    window_s: float = Field(default=600.0, gt=0)
    # A server stopped (SIGSTOP) or not answering /health, or a worker not answering its ping, for this long
    # is recovered like a dead one.
    hung_after_s: float = Field(default=30.0, gt=0)
    # A new replica not placed by Ray within this (its node is gone): it is given up, its rollouts move to the
    # shard's other replicas.
    placement_timeout_s: float = Field(default=30.0, gt=0)
    # Each start of a successor must be done within this; one that is not is stopped and counts as one more
    # start (tried again within max_recoveries). Gym's model servers send their calls again for this long
    # while the worker is being restarted.
    timeout_s: float = Field(default=180.0, gt=0)


class RolloutRecoveryConfig(_Section):
    target_level: RecoveryTargetLevel = RecoveryTargetLevel.SIBLING
    task_source_target_level_overrides: dict[str, RecoveryTargetLevel] = Field(default_factory=dict)
    agent_target_level_overrides: dict[str, RecoveryTargetLevel] = Field(default_factory=dict)
    gym_prepare_timeout_s: float = Field(default=300.0, gt=0)
    # Once the other Gym replicas are prepared, a replica not prepared within this grace leaves the
    # snapshot (its rollouts are not saved in it) instead of holding every replica until the deadline;
    # also how long a status probe waits before a server counts as not answering (docs/design.md §5.8).
    gym_park_grace_s: float = Field(default=1.5, gt=0)
    allow_restart_only_gym_servers: bool = False
    in_run: InRunRecoveryConfig = Field(default_factory=InRunRecoveryConfig)

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            old = [k for k in _REMOVED_RECOVERY_KEYS if k in data]
            if old:
                raise ValueError(
                    "removed keys "
                    + ", ".join(f"rollout_recovery.{k}" for k in old)
                    + "; use rollout_recovery.target_level and the *_target_level_overrides maps"
                )
        return data

    @field_validator("task_source_target_level_overrides", "agent_target_level_overrides")
    @classmethod
    def _coarser_only(cls, overrides: dict, info: ValidationInfo) -> dict:
        base = info.data.get("target_level")
        if base is None:
            return overrides  # target_level itself failed; that error is reported
        for key, level in overrides.items():
            if not level.is_coarser_or_equal(base):
                raise ValueError(
                    f"rollout_recovery.{info.field_name}.{key}={level.value} is finer than "
                    f"rollout_recovery.target_level={base.value}; overrides may only be "
                    "coarser or equal (prefix < turn < sibling < prompt_group)"
                )
        return overrides

    @field_validator("allow_restart_only_gym_servers")
    @classmethod
    def _needs_gym_saves(cls, allow: bool, info: ValidationInfo) -> bool:
        base = info.data.get("target_level")
        if allow and base is not None and not base.requires_gym_checkpoint:
            raise ValueError(
                "rollout_recovery.allow_restart_only_gym_servers=true only applies when "
                f"rollout_recovery.target_level is turn or prefix (it is {base.value}); "
                "remove the setting or set rollout_recovery.target_level=turn"
            )
        return allow

    @property
    def turn_checkpointing_enabled(self) -> bool:
        return self.target_level.requires_gym_checkpoint

    @property
    def generation_cuts_enabled(self) -> bool:
        """``prefix``: every snapshot also cuts the model calls in flight (gym_patches.checkpoint.cuts)."""
        return self.target_level is RecoveryTargetLevel.PREFIX

    def resolve_for(self, task_source: str | None, agent_name: str | None) -> RecoveryTargetLevel:
        """The level a prompt gets: agent override, then task-source override, then default."""
        if agent_name is not None and agent_name in self.agent_target_level_overrides:
            return self.agent_target_level_overrides[agent_name]
        if task_source is not None and task_source in self.task_source_target_level_overrides:
            return self.task_source_target_level_overrides[task_source]
        return self.target_level


class RolloutCheckpointConfig(_Section):
    snapshot_attempt_interval_s: float | None = Field(default=None, gt=0)  # None: off
    # staged: Gym captures its records in memory while rollouts are held and writes them after resume
    # (the pause is the capture only); blocking: Gym writes its records before rollouts resume. The
    # controller's own files are written after resume in both (rollout_snapshot/stagers.py).
    commit_mode: Literal["staged", "blocking"] = "staged"
    max_consecutive_failures: int = Field(default=3, ge=1)
    keep_latest_k: int = Field(default=2, ge=1)  # snapshots kept per trainer step (anchor)
    # latest: the newest trainer step plus its newest valid rollout snapshot. trainer_checkpoint: the
    # newest trainer step only, every in-flight rollout restarting from its prompt (e.g. after changing
    # the Gym deployment, whose saved sessions would no longer fit).
    restore_mode: Literal["latest", "trainer_checkpoint"] = "latest"
    # SIGTERM or a first Ctrl-C: seconds from the signal to the exit. The final snapshot gets all but
    # the last few (teardown); past the grace the run exits anyway, publishing nothing torn. 25 s fits
    # Slurm's default 30 s between SIGTERM and SIGKILL (docs/design.md §5.11).
    stop_grace_s: float = Field(default=25.0, gt=0)


class NemoGymRolloutFailureConfig(_Section):
    # A /run that has not answered after this long fails as an infrastructure failure (retried from
    # the prompt, preferring another replica).
    rollout_timeout_s: float = Field(default=1800.0, gt=0)


class RolloutFailureConfig(_Section):
    # Attempts of one rollout (one generation of a prompt) before the run stops, naming the server.
    max_infra_attempts_per_prompt: int = Field(default=3, ge=1)
    nemo_gym: NemoGymRolloutFailureConfig = Field(default_factory=NemoGymRolloutFailureConfig)


class StallWatchdogConfig(_Section):
    interval_s: float = Field(default=10.0, gt=0)  # how often progress is checked
    stall_timeout_s: float = Field(default=300.0, gt=0)  # no rollout progressed for this long: a stall
    stall_action: Literal["warn", "abort"] = "warn"  # abort: the run stops, saying what is stuck

    @model_validator(mode="after")
    def _timeout_covers_interval(self) -> "StallWatchdogConfig":
        if self.stall_timeout_s < self.interval_s:
            raise ValueError(
                f"async_rl.stall_watchdog.stall_timeout_s ({self.stall_timeout_s:g}) must be at least "
                f"async_rl.stall_watchdog.interval_s ({self.interval_s:g})"
            )
        return self


class InOrderSamplerConfig(_Section):
    """Upstream's ``in_order`` sampler: groups train in the order they were admitted, and a group for
    step T may start generating once the served weights are at most ``max_lookahead_versions`` older
    than the ones step T trains from (0: today's synchronous controller)."""

    name: Literal["in_order"] = "in_order"
    max_lookahead_versions: int = Field(default=0, ge=0)

    @field_validator("name", mode="before")
    @classmethod
    def _known_sampler(cls, value: Any) -> Any:
        if value != "in_order":
            raise ValueError(f"sampler {value!r} is not implemented here; use 'in_order' (upstream's 'windowed' "
                             "and weight-FIFO samplers are not part of this project)")
        return value


class AsyncRLConfig(_Section):
    """Upstream's ``async_rl`` section: how far generation runs ahead of training, how rollout failures
    and stalls are handled (``single_controller_utils/admission.py`` reads the first four keys)."""

    sampler: InOrderSamplerConfig = Field(default_factory=InOrderSamplerConfig)
    # A step starts training (gradients accumulated group by group) once this many of its groups are
    # complete; it still trains exactly grpo.num_prompts_per_step groups in one optimizer step.
    # None: once all are complete.
    min_groups_for_streaming_train: int | None = Field(default=None, ge=1)
    # Prompt groups generating at once, over every step admitted. None: (lookahead + 1) steps' worth.
    max_inflight_prompts: int | None = Field(default=None, ge=1)
    # Sealed rollouts waiting to be trained; no new group is admitted while this many are. None: no limit.
    max_buffered_rollouts: int | None = Field(default=None, ge=1)
    rollout_failure: RolloutFailureConfig = Field(default_factory=RolloutFailureConfig)
    stall_watchdog: StallWatchdogConfig = Field(default_factory=StallWatchdogConfig)

    @property
    def lookahead(self) -> int:
        return self.sampler.max_lookahead_versions


class MasterConfig(_Section):
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    loss_fn: LossConfig = Field(default_factory=LossConfig)
    policy: RunPolicyConfig = Field(default_factory=RunPolicyConfig)
    data: DataConfig
    env: EnvConfig = Field(default_factory=EnvConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    rollout_recovery: RolloutRecoveryConfig = Field(default_factory=RolloutRecoveryConfig)
    rollout_checkpointing: RolloutCheckpointConfig = Field(default_factory=RolloutCheckpointConfig)
    async_rl: AsyncRLConfig = Field(default_factory=AsyncRLConfig)

    @model_validator(mode="after")
    def _cross_section(self) -> "MasterConfig":
        problems = []
        if self.rollout_checkpointing.snapshot_attempt_interval_s is not None and not self.checkpointing.enabled:
            problems.append(
                "rollout_checkpointing.snapshot_attempt_interval_s is set but "
                "checkpointing.enabled=false (snapshots are anchored to trainer checkpoints)"
            )
        if (self.grpo.val_period or self.grpo.val_at_start) and not self.data.val_data_path:
            problems.append("grpo.val_period / grpo.val_at_start ask for validation but data.val_data_path is not set")
        problems += self._async_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _async_problems(self) -> list[str]:
        """``async_rl`` settings that cannot work with this step shape (each names its keys)."""
        a, grpo, problems = self.async_rl, self.grpo, []
        per_step = grpo.num_prompts_per_step
        if a.min_groups_for_streaming_train is not None and a.min_groups_for_streaming_train > per_step:
            problems.append(f"async_rl.min_groups_for_streaming_train ({a.min_groups_for_streaming_train}) exceeds "
                            f"grpo.num_prompts_per_step ({per_step}): a step never has that many groups")
        rollouts = per_step * grpo.num_generations_per_prompt
        if a.max_buffered_rollouts is not None and a.max_buffered_rollouts < rollouts:
            problems.append(f"async_rl.max_buffered_rollouts ({a.max_buffered_rollouts}) is below one step's rollouts "
                            f"(grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {rollouts}): "
                            "a step could never be admitted whole")
        if (grpo.deterministic and a.min_groups_for_streaming_train is not None
                and a.min_groups_for_streaming_train < per_step):
            problems.append(f"grpo.deterministic=true with async_rl.min_groups_for_streaming_train "
                            f"({a.min_groups_for_streaming_train}) below grpo.num_prompts_per_step ({per_step}): "
                            "streaming adds groups in the order they complete, so the step's sums would follow "
                            "arrival; unset async_rl.min_groups_for_streaming_train or grpo.deterministic")
        if a.lookahead > 0 and not grpo.use_generation_logprobs:
            problems.append(f"async_rl.sampler.max_lookahead_versions={a.lookahead} trains on rollouts generated by "
                            "older weights: set grpo.use_generation_logprobs=true so the loss's importance ratio "
                            "is taken against the policy that generated them")
        return problems

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe dict (enums as strings); loads back with ``MasterConfig(**d)``."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ----- embedded default ----------------------------------------------------
# The Gym deployment of the default run (Workplace + simple_agent, all servers
# save sessions). Paths resolve against the repo root; the inline dict holds
# server instance names plus Gym global keys, laid over the files. Edit here.
DEFAULT_NEMO_GYM_CONFIG_PATHS: list[str] = ["examples/gym_configs/workplace.yaml"]
DEFAULT_NEMO_GYM_CONFIG: dict[str, Any] = {
    "default_host": "127.0.0.1",
}

DEFAULT_CONFIG: dict[str, Any] = {
    # Only what the main job sets differently from the schema defaults above (one source per
    # key; tests/unit/test_config.py checks that no value here repeats its schema default).
    # 32 rollouts per step for 40 steps: enough group signal for GRPO to lift reward
    # on 2 CPU cores in a few minutes (tuned with examples/local_learning_check.py).
    "grpo": {"num_generations_per_prompt": 8, "max_num_steps": 40, "val_period": 10},
    "policy": {"device": "cpu"},
    "data": {
        "train_data_path": "examples/data/workplace_train.jsonl",
        "val_data_path": "examples/data/workplace_val.jsonl",
    },
    "env": {"nemo_gym": {"config_paths": DEFAULT_NEMO_GYM_CONFIG_PATHS, "config": DEFAULT_NEMO_GYM_CONFIG}},
    "cluster": {"num_cpus": 2},
    # The main job shows turn recovery; the schema's default level is sibling.
    "rollout_recovery": {"target_level": "turn"},
    "rollout_checkpointing": {"snapshot_attempt_interval_s": 5.0},
}


def embedded_default_config() -> dict[str, Any]:
    return copy.deepcopy(DEFAULT_CONFIG)


# ----- loading -------------------------------------------------------------
def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read ``path`` and merge it over its ``defaults:`` parents (relative to it)."""
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"{path}: 'defaults' inheritance cycle: {' -> '.join(map(str, chain + (path,)))}")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if data is None:
        raise ConfigError(f"{path}: the config file is empty (it needs at least data.train_data_path, "
                          "or 'defaults: <file>' to inherit one)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config file must be a mapping of sections (grpo:, data:, ...), "
                          f"but its top level is a {type(data).__name__}")
    parents = data.pop("defaults", None)
    if parents is None:
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: 'defaults' must be a file name or a list of file names")
    merged = OmegaConf.create({})
    for parent in parents:
        parent_data = _read_yaml(path.parent / parent, chain + (path,))
        merged = OmegaConf.merge(merged, parent_data)
    merged = OmegaConf.merge(merged, data)
    return OmegaConf.to_container(merged, resolve=False)


def _parse_override(text: str) -> tuple[str, str, Any]:
    """``'++a.b=v'`` -> ``('++', 'a.b', parsed v)``."""
    mode = ""
    for prefix in ("++", "+"):
        if text.startswith(prefix):
            mode, text = prefix, text[len(prefix):]
            break
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {mode}{text!r} must look like key.path=value")
    if raw == "":
        return mode, key, ""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw  # not YAML: keep the literal string
    return mode, key, value


def _schema_knows(model: type[BaseModel], parts: list[str]) -> bool:
    """Whether ``parts`` is a declared field path of ``model`` (nested sections)."""
    current: Any = model
    for part in parts:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return False
        field = current.model_fields.get(part)
        if field is None:
            return False
        current = _section_type(field.annotation)
    return True


def _section_type(annotation: Any) -> Any:
    if get_origin(annotation) is Union or type(annotation).__name__ == "UnionType":
        models = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return annotation


def unknown_key_hint(parts: list[str]) -> str | None:
    """For a dotted key the schema forbids: what to write instead (a did-you-mean over the section's
    keys, else the section's keys). None where the path leaves the schema for a free-form mapping
    (there ``++key=...`` adds the key)."""
    current: Any = MasterConfig
    for depth, part in enumerate(parts):
        section = _section_type(current)
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            if get_origin(section) is list and part.isdigit():
                current = get_args(section)[0]
                continue
            return None  # a free-form mapping (or a scalar): not the schema's to refuse
        if part in section.model_fields:
            current = section.model_fields[part].annotation
            continue
        where = ".".join(parts[:depth])
        names = sorted(section.model_fields)
        close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
        if close:
            fixed = ".".join([*parts[:depth], close[0], *parts[depth + 1:]])
            return f"did you mean '{fixed}'?"
        return f"{where or 'the top level'} has only the keys {', '.join(names)}"
    return None


def _lookup(data: Any, parts: list[str]) -> bool:
    """Whether the path exists in the plain config (dict keys, list indices)."""
    node = data
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def _assign(data: dict[str, Any], parts: list[str], value: Any, key: str) -> None:
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set '{key}': '{'.'.join(parts[:depth])}' is not a mapping")
        if not isinstance(node.get(part), (dict, list)):
            node[part] = {}  # create (or replace a scalar/None) on the way down
        node = node[part]
    last = parts[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"cannot set '{key}': '{'.'.join(parts[:-1])}' is not a mapping")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` (key must exist), ``+key=value`` (must not) and ``++key=value``.

    A key "exists" if the YAML has it or the schema declares it, so a field
    left at its default can be set without ``++``.
    """
    data = copy.deepcopy(data)
    for text in overrides:
        mode, key, value = _parse_override(text)
        parts = key.split(".")
        if key in _RENAMED_KEYS:  # say what it is called now, not that it does not exist
            raise ConfigError(f"override {text!r}: {_RENAMED_KEYS[key]}")
        exists = _lookup(data, parts)
        if mode == "" and not (exists or _schema_knows(MasterConfig, parts)):
            unknown = unknown_key_hint(parts)
            advice = unknown if unknown else f"use '++{key}=...' to add it"  # ++ only where the schema allows it
            raise ConfigError(f"override {text!r}: key '{key}' does not exist in the config ({advice})")
        if mode == "+" and (exists or _schema_knows(MasterConfig, parts)):
            raise ConfigError(f"override {text!r}: key '{key}' already exists (use '++{key}=...')")
        _assign(data, parts, value, key)
    return data


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            hint = unknown_key_hint([str(p) for p in err["loc"]])
            msg = "unknown key (not part of the config schema)" + (f"; {hint}" if hint else "")
        lines.append(f"  - {loc}: {msg}")
    return "\n".join(lines)


def build_config(data: dict[str, Any], source: str = "<dict>") -> MasterConfig:
    """Validate a plain dict into a ``MasterConfig``.

    ``${...}`` interpolations are resolved everywhere except ``env.nemo_gym``:
    Gym YAML uses them for keys only Gym knows (e.g. ``${policy_base_url}``).
    """
    data = copy.deepcopy(data)
    env = data.get("env")
    gym_block = env.pop("nemo_gym", None) if isinstance(env, dict) else None
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(data), resolve=True)
    except Exception as exc:
        raise ConfigError(f"invalid config ({source}): cannot resolve interpolation: {exc}") from None
    if gym_block is not None:
        resolved["env"]["nemo_gym"] = gym_block
    try:
        return MasterConfig.model_validate(resolved)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None


def resolve_config_path(path: str | Path) -> Path:
    """``--config``: relative to the current directory, else to the repository root (where the shipped
    ``examples/configs`` are); neither: the error names both places tried."""
    given = Path(path).expanduser()
    if given.is_absolute() or given.exists():
        return given.resolve()
    fallback = REPO_ROOT / given
    if fallback.exists():
        return fallback
    raise ConfigError(f"--config {path}: no such file ({Path.cwd() / given}, nor {fallback} under the repository root)")


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> MasterConfig:
    """Load YAML (or the embedded default when ``path`` is None), apply overrides, validate."""
    if path is None:
        data, source = embedded_default_config(), "embedded default"
    else:
        data, source = _read_yaml(resolve_config_path(path)), str(path)
    if overrides:
        data = apply_overrides(data, list(overrides))
        source += " + overrides"
    return build_config(data, source)
