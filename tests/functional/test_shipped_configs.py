"""Every shipped config and every command the README documents, run as a user runs them.

Each file in ``examples/configs/`` (found by glob: a config added later is covered
without editing this file) and each command of the README's "Running GRPO with
recovery" block (parsed from the README, so the two stay in sync) runs through
``python examples/run_grpo.py`` from the repository root on the embedded default
model (no ``policy.model_name``), shortened to one step of 2x2 rollouts and a
2-step warm start, in temporary run directories. A command the README annotates
``-> error ... naming 'a' and 'b' (on shard/replica-0, ...)`` must end with that
setup error naming each of them; ``-> UserWarning naming them`` must train and
warn naming the servers of the error just before it; everything else must train
its step. The model cache is shared by the whole module, so each data file's
tokenizer and warm start are built once (docs/design.md §5.6).

A config that joins a cluster that already exists (``cluster.ray_address``:
``grpo_mixed_two_nodes_turn.yaml``) is run with nothing listening at the address
it is given and must end with the documented error naming ``cluster.ray_address``
and the address (docs/usage.md: "cannot be joined within 15 s is an error naming the key
and the address"). Its run on a real two-node cluster is
``tests/functional/test_ray_cluster.py``; everything else it runs (the mixed
data, its warm start, the generation worker, restart-only servers allowed) is
the README's ``grpo_mixed_turn.yaml ... allow_restart_only_gym_servers=true``.

The runs go two at a time, in the order listed (a run waits on process starts
and sockets as much as on the CPU); each test waits only for its own run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from gym_patches.utils.processes import free_port
from testkit.run_harness import REPO, new_marker, reap, run_env

pytestmark = [pytest.mark.functional, pytest.mark.timeout(600)]  # hang guards, loose for a loaded machine

CONFIG_DIR = REPO / "examples" / "configs"
README = REPO / "README.md"
README_SECTION = "## Running GRPO with recovery"
ENTRY = "examples/run_grpo.py"
# One short step: what a user's command needs to show it runs (the step, the warm start, the recovery setup).
SHORT = ["grpo.max_num_steps=1", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
         "policy.warm_start.steps=2", "policy.warm_start.batch_size=4", "logger.progress_bar=false"]
RUN_TIMEOUT_S = 480
PARALLEL = 2  # runs at a time


@dataclass(frozen=True)
class Case:
    name: str
    source: str  # where it is documented: README.md:<line> or the config file
    argv: tuple[str, ...]  # after ``python examples/run_grpo.py``
    error_names: tuple[str, ...] | None = None  # a documented setup error naming these; None: it trains
    warning_names: tuple[str, ...] = ()  # a documented UserWarning naming these


def _names(outcome: str) -> tuple[str, ...]:
    """The quoted server names and the ``shard/replica-N`` names of a README outcome comment."""
    return tuple(re.findall(r"'([^']+)'", outcome) + re.findall(r"\b[\w-]+/replica-\d+\b", outcome))


def readme_commands(text: str | None = None) -> list[Case]:
    """The ``python examples/run_grpo.py`` commands of the README block, with their ``# -> ...`` outcomes."""
    text = README.read_text() if text is None else text
    start = text.index(README_SECTION)
    first_line = text[:start].count("\n") + 1
    body_at = text.index("```bash\n", start) + len("```bash\n")
    body = text[body_at:text.index("```", body_at)]
    offset = first_line + text[start:body_at].count("\n")
    commands: list[tuple[int, str, list[str]]] = []  # (line, command, outcome lines)
    lines = body.splitlines()
    i = 0
    in_outcome = False
    while i < len(lines):
        line, lineno = lines[i].strip(), offset + i
        if line.startswith(f"python {ENTRY}"):
            while line.endswith("\\"):
                i += 1
                line = line[:-1].rstrip() + " " + lines[i].strip()
            commands.append((lineno, line, []))
            in_outcome = False
        elif line.startswith("#") and commands:
            comment = line.lstrip("#").strip()
            if comment.startswith("->"):
                commands[-1][2].append(comment)
                in_outcome = True
            elif in_outcome and lines[i].startswith("#     "):  # an outcome continued
                commands[-1][2].append(comment)
            else:
                in_outcome = False
        i += 1
    cases: list[Case] = []
    last_error: tuple[str, ...] = ()
    for lineno, command, outcome_lines in commands:
        argv = tuple(shlex.split(command)[2:])
        outcome = " ".join(outcome_lines)
        error = warn = None
        if outcome.startswith("-> error"):
            error = last_error = _names(outcome)
            assert error, f"README.md:{lineno}: an error outcome that names nothing: {outcome!r}"
        elif "UserWarning naming them" in outcome:
            warn = last_error
        cases.append(Case(_case_id(argv), f"README.md:{lineno}", argv, error, warn or ()))
    return cases


def _case_id(argv: tuple[str, ...]) -> str:
    """The config's stem, then ``+key`` per override (stable while the README's lines move)."""
    stem = Path(argv[1]).stem if argv[:1] == ("--config",) else "default"
    return stem + "".join("+" + a.split("=", 1)[0].rsplit(".", 1)[-1] for a in argv[2:])


def all_cases() -> list[Case]:
    """The README's commands, then every shipped config as shipped (unless the README already runs it so)."""
    cases = readme_commands()
    documented = {c.argv for c in cases}
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        argv = ("--config", str(path.relative_to(REPO)))
        if argv not in documented:
            cases.append(Case(_case_id(argv), str(path.relative_to(REPO)), argv))
    ids = [c.name for c in cases]
    assert len(set(ids)) == len(ids), f"two cases share an id: {ids}"
    return cases


CASES = all_cases()


def _config_of(argv: tuple[str, ...]):
    from nemo_rl.cli.run_grpo import parse_args
    from nemo_rl.algorithms.single_controller_utils.config import load_config

    args, overrides = parse_args(list(argv))
    return load_config(str(REPO / args.config) if args.config else None, overrides)


# ----------------------------------------------------------------------------- running a command
@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str
    logs: Path
    wall_s: float

    def tail(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout[-2500:]}\n--- stderr\n{self.stderr[-2500:]}"


def run_entry(argv: list[str], root: Path) -> Ran:
    """``python examples/run_grpo.py argv`` from the repository root, in its own session; every process it
    started is gone (killed by pid if it outlived the wait) when this returns."""
    root.mkdir(parents=True, exist_ok=True)
    marker = new_marker()
    env = run_env(marker=marker)
    out, err = root / "stdout.txt", root / "stderr.txt"
    started = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([sys.executable, ENTRY, *argv], cwd=REPO, env=env, stdout=o, stderr=e,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    wall = time.monotonic() - started
    left = reap(marker)
    ran = Ran(proc.returncode, out.read_text(errors="replace"), err.read_text(errors="replace"), root / "logs", wall)
    assert not left, f"processes outlived the run: {left}\n{ran.tail()}"
    return ran


def _dirs(root: Path) -> list[str]:
    return [f"logger.log_dir={root / 'logs'}", f"checkpointing.checkpoint_dir={root / 'ckpt'}"]


@dataclass
class CaseRun:
    case: Case
    argv: list[str]
    error_names: tuple[str, ...] | None
    ran: Ran


def run_case(case: Case, model_cache: Path, root: Path) -> CaseRun:
    """The case's command, shortened, in ``root``; a config that joins a cluster gets an address where
    nothing listens (the documented error then names the key and the address)."""
    config = _config_of(case.argv)
    assert config.policy.is_embedded, f"{case.source}: policy.model_name={config.policy.model_name!r}"
    argv = [*case.argv, *SHORT, f"policy.cache_dir={model_cache}", *_dirs(root)]
    error_names = case.error_names
    if config.cluster.ray_address:
        address = f"127.0.0.1:{free_port()}"
        argv.append(f"cluster.ray_address={address}")
        error_names = ("cluster.ray_address", address)
    return CaseRun(case, argv, error_names, run_entry(argv, root))


class CaseRuns:
    """Every selected case of this module, started ``PARALLEL`` at a time in the order listed."""

    def __init__(self, cases: list[Case], model_cache: Path, root: Path):
        self.pool = ThreadPoolExecutor(PARALLEL)
        self.futures: dict[str, Future] = {
            c.name: self.pool.submit(run_case, c, model_cache, root / re.sub(r"\W", "_", c.name)) for c in cases}

    def result(self, case: Case) -> CaseRun:
        return self.futures[case.name].result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def case_runs(request, tmp_path_factory):
    """One model cache for every case (each data file's tokenizer and warm start are built once); only the
    cases pytest selected run."""
    selected = [item.callspec.params["case"] for item in request.session.items
                if getattr(getattr(item, "module", None), "__name__", None) == __name__
                and "case" in getattr(getattr(item, "callspec", None), "params", {})]
    runs = CaseRuns(selected, tmp_path_factory.mktemp("model_cache"), tmp_path_factory.mktemp("runs"))
    yield runs
    runs.close()


# ----------------------------------------------------------------------------- the tests
def test_readme_block_is_parsed():
    """The parser finds the block's commands and outcomes (else every case below would test nothing)."""
    cases = readme_commands()
    assert len(cases) >= 2 and all(c.argv[:1] == ("--config",) for c in cases), cases
    assert any(c.error_names for c in cases) and any(c.error_names is None for c in cases)
    for c in cases:
        assert (REPO / c.argv[1]).is_file(), f"{c.source}: no such config {c.argv[1]}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_documented_command_runs_on_the_embedded_model(case: Case, case_runs):
    done = case_runs.result(case)
    ran = done.ran
    print(f"{case.source}: {shlex.join(done.argv)}\n-> exit {ran.returncode} in {ran.wall_s:.1f}s")
    errors = [line for line in ran.stderr.splitlines() if line.startswith("error: ")]
    if done.error_names is not None:
        assert ran.returncode == 1 and errors, f"{case.source}: expected the documented error\n{ran.tail()}"
        for name in done.error_names:
            assert name in errors[-1], f"{case.source}: the error does not name {name!r}: {errors[-1]}"
        assert "Gym ready" not in ran.stdout and not (ran.logs / "metrics.jsonl").exists(), ran.tail()
        return
    assert ran.returncode == 0 and not errors, f"{case.source}: expected one trained step\n{ran.tail()}"
    assert "Embedded model:" in ran.stdout, ran.tail()  # the embedded default, built or reused from the cache
    metrics = [json.loads(line) for line in (ran.logs / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1], metrics
    assert 0.0 <= metrics[0]["reward_mean"] <= 1.0
    if case.warning_names:
        warned = [line for line in ran.stderr.splitlines() if "UserWarning" in line]
        assert warned, f"{case.source}: expected a UserWarning\n{ran.tail()}"
        for name in case.warning_names:
            assert name in warned[0], f"{case.source}: the warning does not name {name!r}: {warned[0]}"


def test_a_task_source_without_demonstrations_is_refused_before_ray(tmp_path):
    """A training row the warm start cannot demonstrate fails at startup, naming the file, the task source
    and the ways out; nothing has started (no Ray, no Gym, nothing written in the run directories)."""
    rows = [json.loads(line) for line in (REPO / "examples/data/workplace_train.jsonl").read_text().splitlines()[:4]]
    rows.append({**rows[0], "id": "mystery-0", "task_source": "mystery",
                 "ground_truth": [{"name": "lookup", "arguments": {"q": "x"}}]})
    data = tmp_path / "odd_train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ran = run_entry([f"data.train_data_path={data}", *SHORT, *_dirs(tmp_path / "run")], tmp_path / "run")
    errors = [line for line in ran.stderr.splitlines() if line.startswith("error: ")]
    assert ran.returncode == 2 and errors, ran.tail()  # a config error: data the run cannot use
    for part in (str(data), "task_source 'mystery'", "'mystery-0'", "ground_truth_outputs", "policy.model_name"):
        assert part in errors[-1], f"{part!r} not in {errors[-1]}"
    logs = tmp_path / "run" / "logs"  # the run writes its config.yaml there before it starts Ray
    assert "Gym ready" not in ran.stdout and not (logs.exists() and any(logs.iterdir())), ran.tail()
