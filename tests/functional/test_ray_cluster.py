"""A run on a Ray cluster that already exists (``cluster.ray_address``), and the loss of one of its nodes.

The test starts its own two-node Ray cluster on loopback with ``ray start``: a head
node offering ``{"node_a": 1, "gym_slot": 1}`` and a worker node offering
``{"node_b": 1, "gym_slot": 1}``, each in its own session and temp dir, each
process of a node marked in its environment so the test can find (and kill)
exactly that node's processes: ``ray start``, raylet, agents, Ray workers and the
Gym servers those workers started. ``ray stop`` is never used (it would stop
every Ray on the machine).

The run is the mixed setup (``grpo_mixed_two_nodes_turn.yaml``: one shard on two
replicas, each replica's ``NemoGym`` actor asking for one ``gym_slot``, with
``allow_restart_only_gym_servers=true``), scripted test backend and recording
trainer, so the checks are about placement and recovery, not learning.

What a node loss does (docs/faults.md, "A Ray node dies"): with the in-run recovery (the default,
docs/design.md §5.12) the run goes on by itself: the lost replica cannot be placed again (its
``gym_slot`` went with the node), so its saved rollouts move to the survivor and continue at their
turn. With it off (``rollout_recovery.in_run.enabled=false``) the run stops with an error naming the
lost replica (``GymReplicaLost``), in bounded time; once the node is back the same command resumes
from the newest committed snapshot and finishes. Either way every prompt group is trained exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from gym_patches.utils.processes import free_port, processes_with_env
from tests.functional.rl_run import (
    RunDirs,
    env_for,
    replies,
    wait_for_no_processes,
)

pytestmark = [pytest.mark.functional, pytest.mark.timeout(420)]

NODE_ENV = "NEMO_RL_TEST_RAY_NODE"  # marks every process of one test Ray node
# Loopback only. Ray replaces 127.0.0.1 (as a node address and in the head's address) by the
# machine's outward address, unless this is "0"; then every Ray process it is set for (nodes,
# their workers, the run's driver) takes 127.0.0.1 as its address. Only `ray start` of a
# worker node refuses it, so _RAY_START lifts that refusal in its own process and keeps the
# 127.0.0.1 it is given.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
_RAY_START = textwrap.dedent("""
    import sys
    import ray._private.ray_constants as constants
    import ray._private.services as services
    constants.ENABLE_RAY_CLUSTER = True
    services.resolve_ip_for_localhost = lambda host: host
    from ray.scripts.scripts import main
    sys.argv[0] = "ray"
    sys.exit(main())
""")
SHARD = "nemo_gym"
REPLICAS = (f"{SHARD}/replica-0", f"{SHARD}/replica-1")
ARGS_BASE = [
    "--config", "examples/configs/grpo_mixed_two_nodes_turn.yaml",
    "policy.model_name=scripted-test-backend",
    "rollout_checkpointing.snapshot_attempt_interval_s=0.5",
]
STEPS, PROMPTS, GENERATIONS = 4, 4, 4
REPLY_DELAY_S = 0.5  # scripted backend: keeps rollouts in flight for a few seconds
REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the cluster
def _node_env(marker: str) -> dict[str, str]:
    env = env_for()
    env.pop("NEMO_RL_TEST_RUN_ID", None)  # a node is not part of any run
    env.pop("NEMO_RL_RUN_ID", None)
    env[NODE_ENV] = marker
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.update(LOOPBACK_ENV)
    return env


class RayNode:
    """One ``ray start --block`` node in its own session; ``kill()`` takes down every process it started."""

    def __init__(self, name: str, root: Path, temp_root: Path, resources: dict[str, float], *, head_port: int,
                 head: bool):
        self.name, self.resources, self.head = name, resources, head
        self.head_port = head_port
        self.root, self.temp_root = root, temp_root  # logs of `ray start`; Ray's session dirs (short paths)
        self.marker = ""
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.marker = uuid.uuid4().hex
        temp = self.temp_root / f"{self.name}{self.starts}"  # a fresh session dir per start
        temp.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-c", _RAY_START, "start", "--block", "--disable-usage-stats",
            "--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0",
            f"--resources={json.dumps(self.resources)}", "--object-store-memory=100000000",
            f"--temp-dir={temp}", f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
        ]
        if self.head:
            cmd += ["--head", f"--port={self.head_port}", "--include-dashboard=false"]
        else:
            cmd += [f"--address=127.0.0.1:{self.head_port}"]
        env = _node_env(self.marker)
        log = open(self.root / f"{self.name}-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def check_running(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            log = (self.root / f"{self.name}-{self.starts}.log").read_text(errors="replace")
            raise AssertionError(f"Ray node {self.name} exited ({self.proc.returncode}): {log[-3000:]}")

    def pids(self) -> list[int]:
        return processes_with_env(NODE_ENV, self.marker) if self.marker else []

    def kill(self) -> None:
        """SIGKILL every process of this node (as a machine that loses power), and wait until none is left."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while True:
            left = self.pids()
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        left, self.proc = self.pids(), None
        assert not left, f"processes of Ray node {self.name} outlived SIGKILL: {self.pids()}"


_QUERY = textwrap.dedent("""
    import json, sys
    import ray
    import ray._private.state as state
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    nodes = [{"node_id": n["NodeID"], "alive": n["Alive"], "resources": n["Resources"]} for n in ray.nodes()]
    actors = [{"class": a.get("ActorClassName"), "state": a.get("State"), "pid": a.get("Pid"),
               "node_id": (a.get("Address") or {}).get("NodeID")} for a in state.actors().values()]
    print("QUERY" + json.dumps({"nodes": nodes, "actors": actors}))
    ray.shutdown()
""")


class LoopbackCluster:
    """A head (``node_a``) and a worker (``node_b``) on 127.0.0.1, one ``gym_slot`` each."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        # Ray's unix sockets live under the temp dir, and their paths may not exceed 107 bytes.
        self.temp_root = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))
        self.port = free_port()
        self.head = RayNode("head", self.root, self.temp_root, {"node_a": 1, "gym_slot": 1}, head_port=self.port,
                            head=True)
        self.worker = RayNode("worker", self.root, self.temp_root, {"node_b": 1, "gym_slot": 1},
                              head_port=self.port, head=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> "LoopbackCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for node in (self.worker, self.head):
            with contextlib.suppress(AssertionError):
                node.kill()
        shutil.rmtree(self.temp_root, ignore_errors=True)

    def start(self, timeout_s: float = 90) -> None:
        self.head.start()
        self.wait_for(lambda s: self._alive_with(s, "node_a"), timeout_s, "the head node")
        self.worker.start()
        self.wait_for(lambda s: self._alive_with(s, "node_b"), timeout_s, "the worker node")

    def restart_worker(self, timeout_s: float = 90) -> None:
        """Bring the worker back (a new Ray node: a new node id) once Ray knows the old one is dead."""
        self.wait_for(lambda s: not self._alive_with(s, "node_b"), timeout_s, "Ray to mark the lost node dead")
        self.worker.start()
        self.wait_for(lambda s: self._alive_with(s, "node_b"), timeout_s, "the restarted worker node")

    @staticmethod
    def _alive_with(state: dict, resource: str) -> list[str]:
        return [n["node_id"] for n in state["nodes"] if n["alive"] and resource in n["resources"]]

    def query(self, timeout_s: float = 60) -> dict:
        """Nodes and actors as Ray's GCS knows them, from a short-lived driver (never this test process)."""
        env = _node_env("query-" + uuid.uuid4().hex)
        proc = subprocess.run([sys.executable, "-c", _QUERY, self.address], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
        for line in proc.stdout.splitlines():
            if line.startswith("QUERY"):
                return json.loads(line[len("QUERY"):])
        raise AssertionError(f"cluster query failed ({proc.returncode}): {proc.stderr[-2000:]}")

    def wait_for(self, cond, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            for node in (self.head, self.worker):
                node.check_running()
            try:
                state = self.query(timeout_s=30)
                if cond(state):
                    return state
            except (AssertionError, subprocess.TimeoutExpired):
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
            time.sleep(0.5)

    def node_names(self, state: dict) -> dict[str, str]:
        """Alive node id -> ``head`` / ``worker``."""
        out = {}
        for n in state["nodes"]:
            if n["alive"]:
                out[n["node_id"]] = "head" if "node_a" in n["resources"] else "worker"
        return out

    def gym_placement(self, log_dir: Path) -> dict[str, dict]:
        """Replica -> where its ``NemoGym`` actor runs, from two independent sources that must agree.

        Ray's GCS gives each alive ``NemoGym`` actor's node and pid. The replica an
        actor serves is read from the Gym server processes it started: each one's
        stdout is ``<log_dir>/gym-instances/<shard>/replica-<i>/<server>.log``, and
        each carries the environment marker of the node whose raylet started it.
        """
        state = self.query()
        names = self.node_names(state)
        gym_dir = str(Path(log_dir).resolve() / "gym-instances")
        placement: dict[str, dict] = {}
        for actor in state["actors"]:
            if actor["class"] != "NemoGym" or actor["state"] != "ALIVE":
                continue
            replicas = set()
            servers_on = set()
            for child in _children(actor["pid"]):
                try:
                    out = os.readlink(f"/proc/{child}/fd/1")
                except OSError:
                    continue
                if out.startswith(gym_dir + "/"):
                    shard, replica = Path(out).relative_to(gym_dir).parts[:2]
                    replicas.add(f"{shard}/{replica}")
                    servers_on |= {n.name for n in (self.head, self.worker) if child in n.pids()}
            assert len(replicas) == 1, f"NemoGym actor pid {actor['pid']} serves {replicas}"
            placement[replicas.pop()] = {"node_id": actor["node_id"], "node": names.get(actor["node_id"]),
                                         "pid": actor["pid"], "servers_on": sorted(servers_on)}
        return placement


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


# ----------------------------------------------------------------------------- the run
def _run_watching(args: list[str], env: dict[str, str], out_path: Path, watch, timeout_s: float) -> tuple[int, bool]:
    """Run ``run_grpo.py`` in its own session, output to ``out_path``, calling ``watch()`` while it lives.

    Returns (exit code, timed out); a run still alive after ``timeout_s`` is SIGKILLed (a hang).
    """
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "run_grpo.py"), *args], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                watch()
                time.sleep(0.05)
            timed_out = proc.poll() is None
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    return proc.returncode, timed_out


# ----------------------------------------------------------------------------- checks
def _turn_level(snapshot_path: str) -> dict[str, list[str]] | None:
    """``turn_level`` (replica -> saved capture keys) of a published snapshot; None once pruned."""
    try:
        return json.loads((Path(snapshot_path) / "gym_checkpoint.json").read_text())["turn_level"]
    except (OSError, ValueError, KeyError):
        return None


def _check_exactly_once(batches: list[dict]) -> set[str]:
    groups = [g for b in batches for g in b["groups"]]
    assert len(groups) == len(set(groups)) == STEPS * PROMPTS, groups
    rollouts = [r for b in batches for r in b["rollout_ids"]]
    assert len(rollouts) == len(set(rollouts)) == STEPS * PROMPTS * GENERATIONS
    for b in batches:  # one sample per generation of every group
        for g in b["groups"]:
            assert sorted(int(r.split("_g")[1].split("_")[0]) for r in b["rollout_ids"]
                          if r.startswith(g + "_g")) == list(range(GENERATIONS)), (g, b["rollout_ids"])
    return set(rollouts)


@pytest.fixture
def cluster(tmp_path):
    with LoopbackCluster(tmp_path / "ray") as c:
        c.start()
        yield c


def test_existing_two_node_cluster_places_a_replica_per_node_and_a_lost_node_stops_then_resumes(tmp_path, cluster):
    """In-run recovery off: the relaunch path."""
    dirs = RunDirs(tmp_path / "run")
    marker = uuid.uuid4().hex
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": marker, **LOOPBACK_ENV})
    args = (ARGS_BASE + replies(REPLY_DELAY_S) + [f"cluster.ray_address={cluster.address}", f"grpo.max_num_steps={STEPS}"]
            + ["rollout_recovery.in_run.enabled=false"] + dirs.overrides())
    seen: dict = {}
    out1 = tmp_path / "run1.txt"

    def place_then_kill_the_worker() -> None:
        """First (once Gym is up) read where the replicas are; then, at the first committed snapshot after a
        trained step that saved rollouts on the worker's replica, SIGKILL the worker node (the run is
        generating then: snapshots are taken only while some group generates). Never kills the run."""
        if "placement" not in seen:
            if "Gym ready in" in out1.read_text(errors="replace"):
                seen["placement"] = cluster.gym_placement(dirs.logs)
                seen["snapshots_then"] = len(dirs.records("snapshots.jsonl"))
            return
        if "killed_at" in seen:
            return
        on_worker = [r for r, p in seen["placement"].items() if p["node"] == "worker"]
        for s in dirs.records("snapshots.jsonl")[seen["snapshots_then"]:]:
            turn = _turn_level(s["path"]) if s.get("committed") and s.get("saved") and s["step"] >= 1 else None
            if turn and on_worker and turn.get(on_worker[0]):
                cluster.worker.kill()
                seen["killed_at"] = time.monotonic()
                seen["killed_after_snapshot"] = s
                seen["step_at_kill"] = len(dirs.records("metrics.jsonl"))
                return

    started = time.monotonic()
    returncode, hung = _run_watching(args, env, out1, place_then_kill_the_worker, timeout_s=150)
    ended = time.monotonic()
    left = wait_for_no_processes(marker)
    text = out1.read_text(errors="replace")
    print(f"run 1: exit {returncode} after {ended - started:.1f}s; placement {seen.get('placement')}")

    # 1. Placement: one replica per node, by resource; Ray's view and the Gym server processes agree.
    placement = seen["placement"]
    assert set(placement) == set(REPLICAS), placement
    assert sorted(p["node"] for p in placement.values()) == ["head", "worker"], placement
    for replica, p in placement.items():
        assert p["servers_on"] == [p["node"]], f"{replica}: Gym servers on {p['servers_on']}, actor on {p['node']}"
    lost = next(r for r, p in placement.items() if p["node"] == "worker")

    # 2. The worker node died mid-step, with a snapshot that saved rollouts on its replica committed.
    assert "killed_at" in seen, f"no snapshot saved rollouts on {lost} before the run ended:\n{text[-3000:]}"
    assert not hung, f"the run did not stop by itself within 150s (hang):\n{text[-3000:]}"
    assert seen["step_at_kill"] < STEPS
    stopped_after = ended - seen["killed_at"]
    print(f"node killed after step {seen['step_at_kill']}; the run stopped {stopped_after:.1f}s later")
    assert stopped_after < 60, stopped_after
    assert returncode == 1, text[-3000:]
    error = [line for line in text.splitlines() if line.startswith("error: ")]
    print(error)
    assert error and f"Gym replica {lost} (Ray node {placement[lost]['node_id']}," in error[-1], text[-3000:]
    assert "was lost" in error[-1] and "run the same command again once its node is back" in error[-1]
    assert "To go on without the node, run it with fewer replicas of shard" in error[-1]
    assert "Task exception was never retrieved" not in text
    # the run's own record of where each replica ran agrees with Ray's view
    recorded = json.loads((dirs.logs / "gym_placement.json").read_text())
    assert {r: p["node_id"] for r, p in recorded.items()} == {r: p["node_id"] for r, p in placement.items()}
    assert left == [], f"processes of the stopped run outlived it: {left}"
    assert len(dirs.records("metrics.jsonl")) < STEPS
    committed = [s for s in dirs.records("snapshots.jsonl") if s.get("committed")]
    newest = committed[-1]
    newest_turn = _turn_level(newest["path"])
    assert newest_turn is not None
    # The surviving replica's actor went with the run: Ray holds no alive NemoGym actor.
    cluster.wait_for(lambda s: not [a for a in s["actors"] if a["class"] == "NemoGym" and a["state"] == "ALIVE"],
                      30, "the stopped run's NemoGym actors to go")

    # 3. The node comes back (a new Ray node); the same command resumes from the newest snapshot and finishes,
    #    again with one replica per node.
    old_worker = placement[lost]["node_id"]
    cluster.restart_worker()
    again: dict = {}
    out2 = tmp_path / "run2.txt"

    def place_again() -> None:
        if not again and "Gym ready in" in out2.read_text(errors="replace"):
            again.update(cluster.gym_placement(dirs.logs))

    started = time.monotonic()
    returncode, hung = _run_watching(args, env, out2, place_again, timeout_s=180)
    text = out2.read_text(errors="replace")
    print(f"run 2: exit {returncode} after {time.monotonic() - started:.1f}s; placement {again}")
    assert not hung and returncode == 0, text[-3000:]
    assert wait_for_no_processes(marker) == []
    assert set(again) == set(REPLICAS) and sorted(p["node"] for p in again.values()) == ["head", "worker"], again
    assert old_worker not in {p["node_id"] for p in again.values()}
    restore = dirs.restore_json()
    print({k: v for k, v in restore.items() if not k.endswith("_ids") and k != "restored_instances"})
    assert restore["snapshot"] == newest["path"]
    assert [m["step"] for m in dirs.records("metrics.jsonl")][-1] == STEPS

    # 4. Every group trained exactly once; every rollout the snapshot saved continued on its replica.
    batches = json.loads((dirs.ckpt / f"step_{STEPS}" / "recording_trainer.json").read_text())["batches"]
    trained = _check_exactly_once(batches)
    saved = {key: iid for iid, keys in newest_turn.items() for key in keys}
    restored = restore["restored_instances"]
    assert saved and restored, (saved, restored)
    print("saved in the snapshot, per replica:", {iid: len(keys) for iid, keys in newest_turn.items()},
          "restored, per replica:", {iid: list(restored.values()).count(iid) for iid in REPLICAS})
    ran_on = {rid: iid for b in batches for rid, iid in b["gym_instances"].items()}
    continued = {rid: where for b in batches for rid, where in b["restored_from"].items()}
    for key, iid in restored.items():
        assert key in trained and ran_on[key] == iid
        assert continued.get(key) in ("B0", "P1", "P2"), f"{key} did not continue from its boundary"
    # nothing the snapshot held was lost: each saved rollout was either continued (next attempt) or had
    # sealed before the snapshot (then it is trained as it was)
    for key, iid in saved.items():
        base = key.rsplit("-a", 1)[0] if "-a" in key else key
        nxt = f"{base}-a{int(key.rsplit('-a', 1)[1]) + 1 if '-a' in key else 1}"
        assert nxt in restored or key in trained, f"{key} saved on {iid} is neither continued nor trained"
    assert set(restore["restarted_rollout_ids"]) <= trained
    assert set(restore["kept_rollout_ids"]) <= trained
    assert lost in set(restored.values()) | {ran_on[k] for k in restore["restarted_rollout_ids"]}


def test_a_lost_worker_node_moves_its_replicas_rollouts_to_the_survivor_and_the_run_goes_on(tmp_path, cluster):
    """In-run recovery (the default): the worker node is SIGKILLed right after a snapshot saved rollouts on its
    replica; no new replica can be placed (the ``gym_slot`` went with the node), so after
    ``placement_timeout_s`` the replica is given up and its saved rollouts continue on the head's replica."""
    dirs = RunDirs(tmp_path / "run")
    marker = uuid.uuid4().hex
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": marker, **LOOPBACK_ENV})
    args = (ARGS_BASE + replies(REPLY_DELAY_S) + [f"cluster.ray_address={cluster.address}", f"grpo.max_num_steps={STEPS}",
                                                  "rollout_recovery.in_run.placement_timeout_s=5",
                                                  "rollout_checkpointing.keep_latest_k=100", "checkpointing.keep_top_k=100"]
            + dirs.overrides())
    seen: dict = {}
    out = tmp_path / "run.txt"

    def place_then_kill_the_worker() -> None:
        if "placement" not in seen:
            if "Gym ready in" in out.read_text(errors="replace"):
                seen["placement"] = cluster.gym_placement(dirs.logs)
            return
        if "killed_at" in seen:
            return
        on_worker = [r for r, p in seen["placement"].items() if p["node"] == "worker"]
        committed = [s for s in dirs.records("snapshots.jsonl") if s.get("committed")]
        for s in committed[-1:]:  # the newest only (what a recovery restores from): a stale one may hold
            turn = _turn_level(s["path"]) if s.get("saved") else None  # rollouts that have ended since
            if turn and on_worker and turn.get(on_worker[0]):
                cluster.worker.kill()
                seen["killed_at"] = time.monotonic()
                return

    returncode, hung = _run_watching(args, env, out, place_then_kill_the_worker, timeout_s=240)
    text = out.read_text(errors="replace")
    assert "killed_at" in seen, f"no snapshot saved rollouts on the worker's replica:\n{text[-3000:]}"
    assert not hung and returncode == 0, text[-3000:]
    assert wait_for_no_processes(marker) == []
    lost = next(r for r, p in seen["placement"].items() if p["node"] == "worker")
    survivor = next(r for r in REPLICAS if r != lost)
    rows = [json.loads(line) for line in (dirs.logs / "recoveries.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["instance"] == lost and rows[0]["action"] == "moved", rows
    assert "did not place" in rows[0]["given_up"], rows[0]
    held = set((_turn_level(rows[0]["snapshot"]) or {}).get(lost, []))
    assert rows[0]["continued_turn"] and set(rows[0]["continued_turn"]) <= held, rows[0]
    assert not set(rows[0]["restarted_from_prompt"]) & held, rows[0]
    batches = json.loads((dirs.ckpt / f"step_{STEPS}" / "recording_trainer.json").read_text())["batches"]
    trained = _check_exactly_once(batches)
    ran_on = {rid: iid for b in batches for rid, iid in b["gym_instances"].items()}
    for key in rows[0]["continued_turn"]:  # each continued on the survivor at its next attempt
        base, attempt = key.rsplit("-a", 1) if "-a" in key else (key, "0")
        nxt = f"{base}-a{int(attempt) + 1}"
        if nxt in trained:
            assert ran_on[nxt] == survivor, (nxt, ran_on[nxt])
    assert f"recovered {lost}: " in text
