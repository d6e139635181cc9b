"""A write that fails on a real full (or read-only) filesystem ends the run with one named line.

Each test mounts a small tmpfs of its own (``mount -t tmpfs -o size=...``; the
test machines run as root) and fills it with a filler file, so the kernel
itself answers ENOSPC: no injection. What is checked:

- the run stops with exit 1 and ONE ``error: cannot write <file>: [Errno 28]
  No space left on device`` line on stderr, no traceback, no process left;
- a trainer step that could not be written is not published (no ``step_N``,
  its ``.tmp-step_N`` removed), every published step verifies, rollout
  snapshots on the full disk failed alone as ``io_error`` meanwhile;
- once the space is back the same command finishes, every prompt group
  trained exactly once (the recording trainer's lineage);
- the real GRPO trainer's save names the weights / tokenizer / optimizer file
  that did not fit (safetensors reports no file and no ``OSError``).
"""

from __future__ import annotations

import contextlib
import errno
import math
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from nemo_rl.algorithms.recording_trainer import STATE_FILE
from nemo_rl.utils.snapshot_store import verify_directory
from nemo_rl.utils.write_errors import RunWriteError
from testkit.run_harness import RunOutcome, run_once
from testkit.write_faults import write_fault_overrides
from testkit.write_gate import gate_overrides
from tests.functional.rl_run import RunDirs, env_for, load_crash_matrix, replies

pytestmark = [pytest.mark.functional, pytest.mark.timeout(240)]

PAGE = 4096
STEPS = 2


cm = load_crash_matrix()


def _args(config: str = "grpo_workplace_turn.yaml") -> list[str]:
    return ["--config", f"examples/configs/{config}", "policy.model_name=scripted-test-backend", *replies(0.2),
            "logger.plot=false",
            f"grpo.max_num_steps={STEPS}", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
            "rollout_checkpointing.snapshot_attempt_interval_s=0.3",
            # Snapshots on the full disk fail as io_error and the run goes on until the trainer checkpoint.
            "rollout_checkpointing.max_consecutive_failures=1000"]


# ----------------------------------------------------------------------------- a real full filesystem
@pytest.fixture
def mount_tmpfs():
    """``mount(dir, size_kib)``: a tmpfs of that size on ``dir``; every one is unmounted at teardown."""
    mounted: list[Path] = []

    def mount(path: Path, size_kib: int) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        if shutil.which("mount") is None:
            pytest.skip("no mount(8) here: these tests need a real tmpfs to fill")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"mount -t tmpfs is not permitted here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)  # a straggler still holds it


def fill(directory: Path) -> Path:
    """Append to ``directory/filler`` until the filesystem says ENOSPC (again each call: it stays full)."""
    path = directory / "filler"
    with open(path, "ab", buffering=0) as f:
        with contextlib.suppress(OSError):
            while f.write(b"\0" * (64 * 1024)):
                pass
    return path


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _assert_one_clean_error(outcome: RunOutcome, file: Path, why: str = "[Errno 28] No space left on device") -> str:
    """Exit 1, exactly one ``error:`` line naming ``file`` and the OS error, no traceback, nothing left running."""
    stderr = outcome.stderr()
    assert outcome.returncode == 1, (outcome.returncode, stderr[-3000:])
    lines = _error_lines(stderr)
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0] == f"error: cannot write {file}: {why}", lines[0]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert outcome.leftover == [], f"processes of the run outlived it: {outcome.leftover}"
    return lines[0]


def _run(dirs: RunDirs, args: list[str], name: str, **kw) -> RunOutcome:
    return run_once(args, env=env_for(), stdout_path=dirs.root / f"{name}.out",
                    stderr_path=dirs.root / f"{name}.err", timeout_s=180, **kw)


def _finish_and_check_lineage(dirs: RunDirs, args: list[str]) -> None:
    """The same command once there is space again: it finishes, every prompt group trained exactly once."""
    outcome = _run(dirs, args, "rerun")
    assert outcome.returncode == 0, outcome.tail(30)
    assert outcome.leftover == []
    spec = cm.RunSpec(dirs.root, steps=STEPS, prompts=4, generations=4)
    assert cm.check_lineage(spec) == []
    for step in range(1, STEPS + 1):
        if (dirs.ckpt / f"step_{step}").exists():
            verify_directory(dirs.ckpt / f"step_{step}", "trainer_step")


# ----------------------------------------------------------------------------- trainer checkpoint, real runs
@pytest.mark.parametrize("config", ["grpo_workplace_turn.yaml", "grpo_workplace_two_replicas_turn.yaml"])
def test_a_disk_full_at_a_trainer_checkpoint_ends_the_run_naming_the_file_then_the_same_command_finishes(
        tmp_path, mount_tmpfs, config):
    dirs = RunDirs(tmp_path)
    mount_tmpfs(dirs.ckpt, 32 * 1024)
    # Step 2's lineage write waits at a gate until the disk is full and a snapshot has failed on it (under load
    # step 2 was once written before this test's poll filled the disk). No snapshot is pruned: a prune between
    # two fills freed the room step 2's small files needed, and the run finished (seen in CI under load).
    gate = tmp_path / "gate"
    args = (_args(config) + dirs.overrides() + ["rollout_checkpointing.keep_latest_k=1000"]
            + gate_overrides(gate, f".tmp-step_2,{STATE_FILE}"))
    (gate / "armed").touch()
    filled_at: list[float] = []

    def keep_full(elapsed: float) -> bool:
        """Once step_1 is published the disk fills, and stays full (space freed by pruning is taken again);
        step 2's write goes on once a snapshot failed on the full disk."""
        if (dirs.ckpt / "step_1" / "manifest.json").exists():
            fill(dirs.ckpt)
            filled_at[:] = filled_at or [elapsed]
        if filled_at and any(s["reason"] == "io_error" for s in dirs.records("snapshots.jsonl")):
            (gate / "release").touch()
        return False  # never kill: the run must stop by itself

    outcome = _run(dirs, args, "full", kill_when=keep_full)
    assert filled_at, outcome.tail(30)
    assert (gate / "reached").exists(), "step 2's lineage write never reached the gate"
    _assert_one_clean_error(outcome, dirs.ckpt / ".tmp-step_2" / STATE_FILE)
    print(f"[{config}] stopped {outcome.wall_s - filled_at[0]:.1f}s after the disk filled "
          f"(run {outcome.wall_s:.1f}s, cleanup {outcome.cleanup_s:.1f}s)")
    # Nothing torn is published: step 2 is not there, not even as a temp dir; step 1 verifies.
    assert not (dirs.ckpt / "step_2").exists() and not (dirs.ckpt / ".tmp-step_2").exists()
    published = sorted(p for p in dirs.ckpt.iterdir() if p.name.startswith("step_"))
    assert [p.name for p in published] == ["step_1"]
    verify_directory(published[0], "trainer_step")
    # The snapshots the full disk refused failed alone, each named, and the run went on meanwhile.
    failed = [s for s in dirs.records("snapshots.jsonl") if s["reason"] == "io_error"]
    assert failed and all("No space left on device" in s["error"] for s in failed), failed
    assert [m["step"] for m in dirs.records("metrics.jsonl")] == [1, 2]

    (dirs.ckpt / "filler").unlink()
    _finish_and_check_lineage(dirs, args)


def test_an_io_error_at_a_trainer_checkpoint_ends_the_run_the_same_way(tmp_path):
    """EIO cannot be had from a tmpfs: the test's storage writer makes step 2's lineage write fail with it."""
    dirs = RunDirs(tmp_path)
    outcome = run_once(_args() + dirs.overrides() + write_fault_overrides("EIO:recording_trainer.json:2"),
                       timeout_s=180, stderr_path=tmp_path / "run.err", env=env_for())
    _assert_one_clean_error(outcome, dirs.ckpt / ".tmp-step_2" / "recording_trainer.json",
                            "[Errno 5] Input/output error (test-only fault injected by testkit.write_faults:FailingWriter)")
    assert not (dirs.ckpt / "step_2").exists() and not (dirs.ckpt / ".tmp-step_2").exists()


# ----------------------------------------------------------------------------- run records on a full disk
def _records_on_full_disk(dirs: RunDirs, disk: Path, name: str) -> Path:
    """``logs/<name>`` is a link to an empty file on ``disk``, which is then filled: its first line cannot land."""
    (disk / name).touch()
    dirs.logs.mkdir(parents=True, exist_ok=True)
    (dirs.logs / name).symlink_to(disk / name)
    return fill(disk)


def test_a_full_disk_under_metrics_jsonl_ends_the_run_naming_it_and_leaves_no_torn_line(tmp_path, mount_tmpfs):
    dirs = RunDirs(tmp_path)
    disk = mount_tmpfs(tmp_path / "disk", 256)
    filler = _records_on_full_disk(dirs, disk, "metrics.jsonl")
    args = _args() + dirs.overrides()
    outcome = _run(dirs, args, "full")
    _assert_one_clean_error(outcome, dirs.logs / "metrics.jsonl")
    assert (disk / "metrics.jsonl").stat().st_size == 0  # nothing half-written for the next append to glue onto
    # The row is written after the step's checkpoint (it carries checkpoint_s): step 1 is durable, its row is not.
    assert [p.name for p in dirs.ckpt.iterdir() if p.name.startswith("step_")] == ["step_1"]
    filler.unlink()
    _finish_and_check_lineage(dirs, args)
    rows = dirs.records("metrics.jsonl")
    assert [m["step"] for m in rows] == [1, 2]  # the restore wrote step 1's row from the checkpoint
    assert rows[0].get("row_restored") is True and "row_restored" not in rows[1]
    assert all(m["checkpoint_s"] > 0 for m in rows[1:])


def test_a_full_disk_under_snapshots_jsonl_ends_the_run_naming_it(tmp_path, mount_tmpfs):
    """A snapshot's own files failing is an io_error row; the row itself failing has nowhere to go: it stops."""
    dirs = RunDirs(tmp_path)
    disk = mount_tmpfs(tmp_path / "disk", 256)
    _records_on_full_disk(dirs, disk, "snapshots.jsonl")
    started = time.monotonic()
    outcome = _run(dirs, _args() + dirs.overrides(), "full")
    _assert_one_clean_error(outcome, dirs.logs / "snapshots.jsonl")
    print(f"[snapshots.jsonl] stopped {time.monotonic() - started:.1f}s after start (the first attempt's row)")


# ----------------------------------------------------------------------------- in-process writers
def test_restore_json_and_an_append_that_only_half_fits_name_their_file(tmp_path, mount_tmpfs):
    from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords

    disk = mount_tmpfs(tmp_path / "disk", 64)
    (disk / "metrics.jsonl").write_bytes(b"x" * (PAGE - 100) + b"\n")  # one page, 99 bytes of it still free
    fill(disk)
    records = RunRecords(disk)
    with pytest.raises(RunWriteError) as caught:
        records.restore({"trainer_step": 1, "snapshot": None})
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(disk / "restore.json")
    assert str(caught.value) == f"cannot write {disk / 'restore.json'}: [Errno 28] No space left on device"
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "metrics.jsonl"]  # no temp file left
    # 99 bytes of the 500-byte line fit in the page, the rest does not: the file is cut back to its last line.
    with pytest.raises(RunWriteError, match=r"metrics\.jsonl: \[Errno 28\] No space left on device"):
        records.metrics({"step": 1, "pad": "y" * 500})
    assert (disk / "metrics.jsonl").read_bytes() == b"x" * (PAGE - 100) + b"\n"


def test_the_recording_trainer_on_a_read_only_disk_names_its_file(tmp_path, mount_tmpfs):
    from nemo_rl.algorithms.recording_trainer import RecordingTrainer

    disk = mount_tmpfs(tmp_path / "disk", 64)
    (disk / "step").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    with pytest.raises(RunWriteError) as caught:
        RecordingTrainer(tmp_path / "logs").save(disk / "step", {"step": 1})
    assert caught.value.errno == errno.EROFS
    assert str(caught.value) == f"cannot write {disk / 'step' / STATE_FILE}: [Errno 30] Read-only file system"


@pytest.fixture(scope="module")
def grpo_trainer(tmp_path_factory):
    """The real GRPO trainer on a 2-layer Qwen3 built locally (tests/model_fixtures.py), and the size of
    each file its save writes (from one save to an ordinary directory)."""
    from nemo_rl.algorithms.grpo import GRPOTrainer
    from nemo_rl.algorithms.grpo_config import GRPOConfig, LossConfig, PolicyConfig
    from nemo_rl.models.policy import load_policy
    from tests.model_fixtures import tiny_qwen_dir

    model = tiny_qwen_dir(tmp_path_factory.mktemp("tiny"))
    policy = load_policy(str(model), "float32", "cpu", 128)
    trainer = GRPOTrainer(PolicyConfig(device="cpu", max_seq_len=128), LossConfig(), GRPOConfig(seed=0), policy)
    ref = tmp_path_factory.mktemp("ref") / "ck"
    trainer.save(ref)
    return trainer, {p.name: p.stat().st_size for p in ref.iterdir()}


# Files save writes before the one that must not fit (save_pretrained: config, weights; then the tokenizer).
@pytest.mark.parametrize("fits, fails", [
    ((), "model.safetensors"),  # a 64 KiB disk: config.json fits, the 400 KiB weights do not
    (("config.json", "generation_config.json", "model.safetensors"), "chat_template.jinja"),
    (("config.json", "generation_config.json", "model.safetensors", "chat_template.jinja", "tokenizer.json",
      "tokenizer_config.json"), "optimizer.pt"),
])
def test_the_grpo_trainer_save_on_a_full_disk_names_the_file_that_did_not_fit(tmp_path, mount_tmpfs, grpo_trainer,
                                                                              fits, fails):
    trainer, sizes = grpo_trainer
    pages = sum(math.ceil(sizes[name] / PAGE) for name in fits)
    disk = mount_tmpfs(tmp_path / "disk", max(64, pages * PAGE // 1024))
    with pytest.raises(RunWriteError) as caught:
        trainer.save(disk / ".tmp-step_1")
    assert caught.value.errno == errno.ENOSPC
    assert caught.value.filename == str(disk / ".tmp-step_1" / fails), str(caught.value)
    assert str(caught.value) == f"cannot write {disk / '.tmp-step_1' / fails}: [Errno 28] No space left on device"
    assert not any(p.name.endswith(".tmp") for p in (disk / ".tmp-step_1").iterdir())  # no temp file left behind
