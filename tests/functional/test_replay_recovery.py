"""Replay of rollouts on restart-only Gym servers (issue 53, docs/design.md §4.8), end to end: real
``run_grpo`` processes, real Ray actors, real Gym servers on 127.0.0.1, the scripted test backend and the
recording trainer (its lineage keeps each replayed rollout's calls as trained).

The scripted backend holds chosen turns of chosen rows from its start (``BENCH_SCRIPTED_HOLD`` of
``examples/bench/instrument/sitecustomize.py``, with its model-call audit, ``BENCH_AUDIT_DIR``):
a held rollout stops with exactly that many finished calls, and every snapshot after that holds them. The
tests act once the newest committed snapshot's model records hold them (no timing), then:

- SIGKILL the whole run and start the same command: on the one-replica mixed setup (with a sandbox row
  whose second cell prints a fresh uuid, a tool made non-deterministic on purpose) and on 2 shards x 2
  replicas in async mode (lookahead 1). No rollout on a replayable server restarts from its prompt; each
  continues from its recorded calls, whose trained token ids are the record's and never reached the
  backend again (the model-call audit); the non-deterministic rollout replays up to that output and
  generates the rest, and the step row names the divergence (python_sandbox, its call index);
- in-run on 2 x 2: SIGKILL ``python_sandbox`` of ``mixed/replica-1``, then its restart-only agent's
  server: the run goes on, each recovery continues its replayed rollouts by replay;
- ``--check`` with the setting false: replay declared everywhere passes; one server not replayable is
  the only one the error names.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from testkit.run_harness import new_marker, read_jsonl, replica_server_pids, run_env, run_once
from tests.functional.rl_run import REPO, load_crash_matrix

pytestmark = [pytest.mark.functional, pytest.mark.timeout(420)]

cm = load_crash_matrix()
INSTRUMENT = REPO / "examples" / "bench" / "instrument"  # the scripted holds and the model-call audit
HOLD_ENV = "BENCH_SCRIPTED_HOLD"
ONE_REPLICA = "examples/configs/grpo_mixed_replay_turn.yaml"
TWO_SHARDS = "examples/configs/grpo_mixed_two_shards_replay_turn.yaml"
REPLAYED_AGENTS = {"workplace_restart_only_agent", "sandbox_simple_agent"}  # their rollouts come back by replay
NONDETERMINISTIC_USER = "Print n and a fresh uuid, then set answer to that plus 8."


# ----------------------------------------------------------------------------- data
def shipped_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (REPO / "examples" / "data" / name).read_text().splitlines() if line]


def user_text(row: dict) -> str:
    return next(m["content"] for m in row["responses_create_params"]["input"] if m["role"] == "user")


def nondeterministic_sandbox_row(template: dict) -> dict:
    """A sandbox row whose second cell prints a uuid (a fresh interpreter prints another), then two more
    calls: a replay of it stops at call 2, the first request that carries that output."""
    row = copy.deepcopy(template)
    row["id"] = "sandbox-nondeterministic-0000"
    row["responses_create_params"]["input"][1]["content"] = NONDETERMINISTIC_USER
    row["seed"] = {"setup": "n = 5"}
    row["expected_answer"] = "13"
    row["ground_truth"] = [{"name": "python_exec", "arguments": {"code": "print(n)"}},
                           {"name": "python_exec", "arguments": {"code": "import uuid; print(uuid.uuid4())"}},
                           {"name": "python_exec", "arguments": {"code": "answer = 5 + 8"}}]
    return row


def write_rows(path: Path, rows: list[dict]) -> Path:
    users = [user_text(r) for r in rows]
    assert len(users) == len(set(users)), "a held turn is keyed by the user text: rows here must not share one"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- the held backend
class HeldBackend:
    """The run's scripted backend, once the hold instrument wrote its address."""

    def __init__(self, gate: Path):
        self.gate = gate

    @property
    def url(self) -> str | None:
        path = self.gate / "backend_url"
        return path.read_text() if path.exists() else None

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def held(self) -> dict[tuple[str, int], int]:
        return {(h["user"], h["turn"]): h["waiting"] for h in self._call("GET", "/scripted/calls")["held_turns"]}

    def release(self, user: str, turn: int) -> None:
        self._call("POST", "/scripted/release", {"user": user, "turn": turn})


def holds_env(gate: Path | None, holds: dict[str, int], audit: Path) -> dict[str, str]:
    """A run's environment: the model-call audit into ``audit``, and with ``gate`` the holds (user -> turn)."""
    extra = {"BENCH_AUDIT_DIR": str(audit)}
    if gate is not None:
        gate.mkdir(parents=True, exist_ok=True)
        (gate / "holds.json").write_text(json.dumps([[u, t] for u, t in holds.items()]))
        extra[HOLD_ENV] = str(gate)
    return run_env(marker=new_marker(), pythonpath=[INSTRUMENT], extra=extra)


def audit_lines(audit: Path) -> list[dict]:
    return [r for p in sorted(audit.glob("model-*.jsonl")) for r in read_jsonl(p)]


# ----------------------------------------------------------------------------- snapshots
def model_records(snapshot: str | Path) -> dict[str, dict[str, Any]]:
    """capture key -> ``{"instance", "calls"}`` of every model record the snapshot holds (Gym's own files)."""
    out = {}
    for path in Path(snapshot).glob("gym-instances/*/*/gym/model/*/records-*.jsonl"):
        instance = f"{path.parents[4].name}/{path.parents[3].name}"
        for line in path.read_text().splitlines():
            record = json.loads(line)
            e = record["episode_id"]
            key = e["rollout_id"] if e["attempt"] == 0 else f"{e['rollout_id']}-a{e['attempt']}"
            out[key] = {"instance": instance, "calls": record.get("calls", [])}
    return out


def replayed_keys(snapshot: str | Path) -> dict[str, list[str]]:
    return json.loads((Path(snapshot) / "gym_checkpoint.json").read_text()).get("replayed", {})


@dataclass
class SnapshotsSeen:
    """Every committed snapshot's replayed keys and model records, read while it exists (a later step's
    publish prunes the snapshots under the step before)."""

    spec: Any
    replayed: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # path -> instance -> keys
    records: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # path -> key -> record

    def poll(self) -> list[str]:
        """Read the committed snapshots not read yet; returns every committed path, oldest first."""
        paths = [r["path"] for r in read_jsonl(self.spec.logs / "snapshots.jsonl")
                 if r.get("committed") and r.get("path")]
        for path in paths:
            if path not in self.replayed:
                try:
                    self.replayed[path], self.records[path] = replayed_keys(path), model_records(path)
                except FileNotFoundError:  # pruned already
                    self.replayed[path], self.records[path] = {}, {}
        return paths

    def calls(self, path: str, key: str) -> int:
        return len(self.records[path].get(key, {}).get("calls", []))


def row_of(rows: list[dict], rollout_key: str) -> dict:
    """The data row of a rollout (``data.shuffle=false``: group ``s<step>p<position>`` is row ``position``)."""
    group = rollout_key.split("_g", 1)[0]
    return rows[int(group.rsplit("p", 1)[1]) % len(rows)]


def base_key(key: str) -> str:
    """The first attempt's capture key of any attempt's."""
    head, sep, attempt = key.rpartition("-a")
    return head if sep and attempt.isdigit() else key


# ----------------------------------------------------------------------------- checks
def lineage(spec) -> list[dict]:
    return json.loads((spec.ckpt / f"step_{spec.steps}" / "recording_trainer.json").read_text())["batches"]


def trained_replay_calls(spec) -> dict[str, list[dict]]:
    """rollout id -> its calls as trained, for each rollout that came back by replay (the final lineage)."""
    return {k: v for b in lineage(spec) for k, v in b.get("replay_calls", {}).items()}


def token_info(reply: dict) -> dict:
    """The token fields of a recorded reply (on its last output item, where the model server puts them)."""
    item = reply["output"][-1]
    return {"generation_token_ids": item["generation_token_ids"],
            "generation_log_probs": item["generation_log_probs"], "weight_version": item.get("weight_version", 0)}


def check_relaunch_replayed(spec, rows: list[dict], seen: SnapshotsSeen, restore: dict, holds: dict[str, int],
                            audits: tuple[Path, Path]) -> dict[str, list[dict]]:
    """The relaunch continued every held rollout by replay from what the restored snapshot recorded;
    returns the trained calls of the replayed rollouts (by new capture key)."""
    assert restore is not None and restore["snapshot"] in seen.records, restore
    snapshot = restore["snapshot"]
    records = seen.records[snapshot]
    saved = {k for keys in seen.replayed[snapshot].values() for k in keys}
    held = {k for k in saved if user_text(row_of(rows, k)) in holds}
    assert {user_text(row_of(rows, k)) for k in held} == set(holds), (sorted(held), holds)
    for key in held:  # the gate: each held rollout stopped with exactly its held turn's calls
        assert len(records[key]["calls"]) == holds[user_text(row_of(rows, key))], (key, records[key])
    # No rollout on a replayable server restarts from its prompt; each held one continues by replay.
    replayed = set(restore["replayed_rollout_ids"])
    assert restore["restored_replay"] == len(replayed) and {base_key(k) for k in replayed} == saved, restore
    on_replayable = [k for k in restore.get("restarted_rollout_ids", [])
                     if row_of(rows, k)["agent_ref"]["name"] in REPLAYED_AGENTS]
    assert on_replayable == [] and restore["restarted_from_prompt"] == 0, restore
    assert cm.check_restore(restore, cm.trained_rollout_ids(spec), final=True) == []
    trained = trained_replay_calls(spec)
    assert replayed <= set(trained), (sorted(replayed - set(trained)), sorted(trained))
    # The replayed replies are the first attempt's: token ids, logprobs and weight version as recorded.
    for key in replayed:
        recorded = records[base_key(key)]["calls"]
        calls = trained[key]
        replayed_calls = [i for i, c in enumerate(calls) if c["replay"] and c["replay"]["replayed"]]
        diverged = [i for i, c in enumerate(calls) if c["replay"] and c["replay"]["divergence"]]
        expected = min(len(recorded), diverged[0]) if diverged else len(recorded)
        assert replayed_calls == list(range(expected)), (key, [c["replay"] for c in calls])
        for i in replayed_calls:
            assert calls[i]["replay"]["call"] == i
            got = {k: calls[i][k] for k in ("generation_token_ids", "generation_log_probs", "weight_version")}
            assert got == token_info(recorded[i]["reply"]), (key, i)
    # ... and never reached the backend again: the relaunch generated only their later turns.
    first, second = audit_lines(audits[0]), audit_lines(audits[1])
    for key in replayed:
        n = len(records[base_key(key)]["calls"])
        assert sorted(r["turn"] for r in first if r["key"] == base_key(key) and r["status"] == 200) == list(range(n))
        again = sorted(r["turn"] for r in second if r["key"] == key and r["status"] == 200)
        live_from = next((i for i, c in enumerate(trained[key]) if not (c["replay"] and c["replay"]["replayed"])),
                         len(trained[key]))
        assert again == list(range(live_from, len(trained[key]))), (key, again, live_from)
    return {k: trained[k] for k in replayed}


def step_rows(spec) -> list[dict]:
    return [r for r in read_jsonl(spec.logs / "metrics.jsonl") if not r.get("row_restored")]


def check_step_counts(spec, trained: dict[str, list[dict]]) -> list[dict]:
    """The step rows count what the trained samples say: rollouts, calls replayed and live after a
    divergence, and each divergence's site."""
    rows = step_rows(spec)
    counted = {k: sum(r.get(k, 0) for r in rows) for k in ("replay_rollouts", "replay_calls_replayed",
                                                         "replay_calls_live_after_divergence", "replay_divergences")}
    replayed = sum(1 for calls in trained.values() for c in calls if c["replay"] and c["replay"]["replayed"])
    live = sum(len(calls) - i for calls in trained.values() for i, c in enumerate(calls)
               if c["replay"] and c["replay"]["divergence"])
    diverged = sum(1 for calls in trained.values() for c in calls if c["replay"] and c["replay"]["divergence"])
    assert counted == {"replay_rollouts": len(trained), "replay_calls_replayed": replayed,
                       "replay_calls_live_after_divergence": live, "replay_divergences": diverged}, counted
    assert replayed > 0
    return [s for r in rows for s in r.get("replay_divergence_sites", [])]


# ----------------------------------------------------------------------------- relaunch
def kill_and_relaunch(tmp_path: Path, spec, rows: list[dict], holds: dict[str, int], *, min_step: int = 0,
                      timeout_s: float = 200):
    """Run with the holds until the newest committed snapshot (of trainer step >= ``min_step``) holds every
    rollout of the held rows in its replayed model records, each with its held calls; SIGKILL the whole run;
    run the same command without the holds. Returns what the snapshots held, ``restore.json``, the audits."""
    seen = SnapshotsSeen(spec)
    audits = (tmp_path / "audit-1", tmp_path / "audit-2")
    steps: dict[str, int] = {}  # snapshot path -> its trainer step

    def all_held(_elapsed: float) -> bool:
        paths = seen.poll()
        if not paths:
            return False
        newest = paths[-1]
        if min_step:
            steps.update({r["path"]: r.get("step", 0) for r in read_jsonl(spec.logs / "snapshots.jsonl")
                          if r.get("committed")})
            if steps.get(newest, 0) < min_step:
                return False
        per_user: dict[str, int] = {}
        for key in {k for ks in seen.replayed[newest].values() for k in ks}:
            user = user_text(row_of(rows, key))
            if user in holds and seen.calls(newest, key) == holds[user]:
                per_user[user] = per_user.get(user, 0) + 1
        return per_user == {u: spec.generations for u in holds}

    spec.root.mkdir(parents=True, exist_ok=True)
    first = run_once(spec.args(), env=holds_env(tmp_path / "gate", holds, audits[0]), kill_when=all_held,
                     stdout_path=spec.root / "run-1.out", stderr_path=spec.root / "run-1.err", timeout_s=timeout_s)
    assert first.killed_by == "group", (first.killed_by, first.returncode, first.tail(30))
    assert not first.leftover
    seen.poll()  # a snapshot committed in the last poll interval before the kill
    second = run_once(spec.args(), env=holds_env(None, holds, audits[1]),
                      stdout_path=spec.root / "run-2.out", stderr_path=spec.root / "run-2.err", timeout_s=timeout_s)
    assert second.returncode == 0, second.tail(40)
    assert not second.leftover
    return seen, spec.restore_record(), audits


def distinct(rows: list[dict]) -> list[dict]:
    """``rows`` with each user text once (the first row that has it)."""
    out, users = [], set()
    for row in rows:
        if user_text(row) not in users:
            users.add(user_text(row))
            out.append(row)
    return out


def one_replica_rows() -> list[dict]:
    """Step 1: a saving Workplace rollout, a restart-only agent's, a sandbox one, the non-deterministic
    sandbox row; then shipped rows (each user text once)."""
    mixed = distinct(shipped_rows("mixed_train.jsonl"))
    by_agent = lambda name: [r for r in mixed if r["agent_ref"]["name"] == name]  # noqa: E731
    saving, restart_only, sandbox = by_agent("workplace_simple_agent"), by_agent("workplace_restart_only_agent"), \
        by_agent("sandbox_simple_agent")
    return [saving[0], restart_only[0], sandbox[0], nondeterministic_sandbox_row(sandbox[0]),
            saving[1], restart_only[1], saving[2], restart_only[2]]


def two_shards_rows() -> list[dict]:
    """Each step: a saving Workplace row and an arithmetic one (shard ``saving``), a restart-only agent's
    row and a sandbox row (shard ``mixed``, replayed); three steps' worth."""
    mixed = distinct(shipped_rows("mixed_shards_train.jsonl"))
    by_agent = lambda name: [r for r in mixed if r["agent_ref"]["name"] == name]  # noqa: E731
    columns = [by_agent(a) for a in ("workplace_simple_agent", "arithmetic_simple_agent",
                                     "workplace_restart_only_agent", "sandbox_simple_agent")]
    return [column[step] for step in range(3) for column in columns]


def test_one_replica_sigkill_then_the_same_command_continues_each_replayable_rollout_by_replay(tmp_path):
    """One replica, the setting true and replay declared. The restart-only agent's and the sandbox rollout
    are held after 2 finished calls, the non-deterministic one after 3 (the uuid printed by call 1's tool
    is in call 2's request); the run is SIGKILLed once a committed snapshot holds them all."""
    rows = one_replica_rows()
    data = write_rows(tmp_path / "train.jsonl", rows)
    holds = {user_text(rows[1]): 2, user_text(rows[2]): 2, NONDETERMINISTIC_USER: 3}
    spec = cm.RunSpec(tmp_path / "run", config=ONE_REPLICA, steps=2, prompts=4, generations=2, shuffle=False,
                      delay_s=0.05, keep_latest_k=100,
                      extra=["checkpointing.keep_top_k=100", f"data.train_data_path={data}"])
    seen, restore, audits = kill_and_relaunch(tmp_path, spec, rows, holds)
    trained = check_relaunch_replayed(spec, rows, seen, restore, holds, audits)
    assert cm.check_lineage(spec) == []
    sites = check_step_counts(spec, trained)
    # The non-deterministic rollouts replayed calls 0 and 1; call 2 carried the new uuid: generated live from
    # there, and the step row names the site.
    odd = sorted(k for k in trained if user_text(row_of(rows, k)) == NONDETERMINISTIC_USER)
    assert len(odd) == spec.generations
    for key in odd:
        notes = [c["replay"] for c in trained[key]]
        assert [n and n["replayed"] for n in notes] == [True, True, False, None], notes
        assert notes[2]["divergence"]["call"] == 2 and notes[2]["divergence"]["kind"] == "tool_output", notes[2]
    assert sorted((s["rollout_id"], s["call"], s["server"], s["kind"], s["tool"]) for s in sites) == \
        [(k, 2, "python_sandbox", "tool_output", "python_exec") for k in odd]
    # The deterministic ones replayed every recorded call and diverged nowhere.
    for key in set(trained) - set(odd):
        assert not any(c["replay"] and c["replay"]["divergence"] for c in trained[key]), key


def test_two_shards_async_sigkill_then_the_same_command_continues_each_replayable_rollout_by_replay(tmp_path):
    """2 shards x 2 replicas in async mode (lookahead 1): step 2's mixed-shard rollouts (a restart-only
    agent's, a sandbox one) are held after 2 finished calls while step 1 trains and checkpoints; the run is
    SIGKILLed once a committed snapshot under step 1 holds them all, on both mixed replicas."""
    rows = two_shards_rows()
    data = write_rows(tmp_path / "train.jsonl", rows)
    holds = {user_text(rows[6]): 2, user_text(rows[7]): 2}  # step 2's mixed-shard rows
    spec = cm.RunSpec(tmp_path / "run", config=TWO_SHARDS, steps=2, prompts=4, generations=2, shuffle=False,
                      lookahead=1, interval_s=0.25, delay_s=0.05, keep_latest_k=100,
                      extra=["checkpointing.keep_top_k=100", f"data.train_data_path={data}"])
    seen, restore, audits = kill_and_relaunch(tmp_path, spec, rows, holds, min_step=1)
    assert restore["trainer_step"] == 1, restore  # under step 1: the held rollouts generated while it trained
    trained = check_relaunch_replayed(spec, rows, seen, restore, holds, audits)
    saved_on = {base_key(k): iid for iid, keys in seen.replayed[restore["snapshot"]].items() for k in keys}
    assert {saved_on[base_key(k)] for k in trained} == {"mixed/replica-0", "mixed/replica-1"}, saved_on
    assert cm.check_lineage(spec) == []
    assert cm.check_version_lag(spec, spec.lookahead) == []
    assert check_step_counts(spec, trained) == []  # deterministic tools: no divergence


# ----------------------------------------------------------------------------- in-run
class InRunFaults:
    """SIGKILLs ``servers`` of ``replica`` one after the other, each once the previous loss is recovered and
    the newest committed snapshot holds replayed rollouts there at their held turn (for the second and later,
    attempts the previous recovery brought back); then releases the holds."""

    def __init__(self, spec, rows: list[dict], gate: Path, holds: dict[str, int], replica: str, servers: list[str]):
        self.spec, self.rows, self.backend, self.holds = spec, rows, HeldBackend(gate), holds
        self.replica, self.servers = replica, servers
        self.seen = SnapshotsSeen(spec)
        self.sent: list[dict[str, Any]] = []  # server, pid, snapshot, the replayed keys there with calls
        self.released = False

    def tick(self, _elapsed: float) -> bool:
        paths = self.seen.poll()
        recovered = read_jsonl(self.spec.logs / "recoveries.jsonl")
        if len(recovered) < len(self.sent) or not paths:
            return False
        if len(self.sent) == len(self.servers):
            if not self.released:
                for user, turn in self.holds.items():
                    self.backend.release(user, turn)
                self.released = True
            return False
        newest = paths[-1]
        attempt = f"-a{len(self.sent)}" if self.sent else None  # the attempts the last recovery brought back
        keys = self.seen.replayed[newest].get(self.replica, [])
        if not keys or not all(self.seen.calls(newest, k) == self.holds.get(user_text(row_of(self.rows, k)))
                               and (attempt is None or k.endswith(attempt)) for k in keys):
            return False  # every replayed rollout there at its hold (a replay's record holds its queued calls)
        server = self.servers[len(self.sent)]
        pid = replica_server_pids(self.spec.logs, self.replica).get(server)
        if pid is None or any(pid == s["pid"] for s in self.sent):
            return False
        os.kill(pid, signal.SIGKILL)
        self.sent.append({"server": server, "pid": pid, "snapshot": newest, "keys": keys, "at": time.time()})
        return False


def test_two_shards_in_run_a_lost_sandbox_then_a_lost_agent_server_continue_their_rollouts_by_replay(tmp_path):
    """2 shards x 2 replicas: step 1's mixed-shard rollouts held after 2 finished calls; python_sandbox of
    mixed/replica-1 SIGKILLed, then (once that is recovered and a newer snapshot holds the rollouts it brought
    back) the restart-only agent's server there. The run goes on by itself; each recovery continues the
    replica's rollouts by replay, none of them from the prompt."""
    rows = two_shards_rows()
    data = write_rows(tmp_path / "train.jsonl", rows)
    holds = {user_text(rows[2]): 2, user_text(rows[3]): 2}  # step 1's mixed-shard rows
    replica = "mixed/replica-1"
    spec = cm.RunSpec(tmp_path / "run", config=TWO_SHARDS, steps=2, prompts=4, generations=2, shuffle=False,
                      delay_s=0.05, keep_latest_k=100,
                      extra=["checkpointing.keep_top_k=100", f"data.train_data_path={data}"])
    spec.root.mkdir(parents=True)
    faults = InRunFaults(spec, rows, tmp_path / "gate", holds, replica,
                         ["python_sandbox", "workplace_restart_only_agent"])
    result = run_once(spec.args(), env=holds_env(tmp_path / "gate", holds, tmp_path / "audit"), kill_when=faults.tick,
                      stdout_path=spec.root / "run-1.out", stderr_path=spec.root / "run-1.err", timeout_s=300)
    assert len(faults.sent) == 2 and faults.released, (faults.sent, result.tail(30))
    assert result.returncode == 0 and result.killed_by is None, result.tail(40)
    assert spec.restore_record() is None  # no relaunch
    assert not result.leftover
    assert cm.check_lineage(spec) == []
    recoveries = read_jsonl(spec.logs / "recoveries.jsonl")
    assert [(r["instance"], r["part"], r["action"]) for r in recoveries] == [
        (replica, "python_sandbox", "restarted"), (replica, "workplace_restart_only_agent", "restarted")], recoveries
    for row, fault in zip(recoveries, faults.sent):
        saved = set(faults.seen.replayed[row["snapshot"]].get(replica, []))
        assert row["continued_replay"] and set(row["continued_replay"]) <= saved, (row, sorted(saved))
        assert not set(row["restarted_from_prompt"]) & saved, row
        assert row["continued_turn"] == [] and row["continued_prefix"] == [], row
        assert set(fault["keys"]) & set(row["continued_replay"]), (fault, row)  # those with calls among them
        assert f"{len(row['continued_replay'])} by replay" in result.stderr() + result.stdout()
    # The second recovery brought back attempts the first had brought back: replayed twice, trained once,
    # their replayed calls the record's.
    last = recoveries[-1]
    records = faults.seen.records[last["snapshot"]]
    trained = trained_replay_calls(spec)
    for key in last["continued_replay"]:
        head, _, attempt = key.rpartition("-a")
        nxt = f"{head}-a{int(attempt) + 1}" if _ else f"{key}-a1"
        calls = trained[nxt]
        recorded = records[key]["calls"]
        assert len(recorded) == holds[user_text(row_of(rows, key))], (key, recorded)
        assert [bool(c["replay"] and c["replay"]["replayed"]) for c in calls[:len(recorded)]] == [True] * len(recorded)
        for i, call in enumerate(recorded):
            got = {k: calls[i][k] for k in ("generation_token_ids", "generation_log_probs", "weight_version")}
            assert got == token_info(call["reply"]), (nxt, i)
    assert check_step_counts(spec, trained) == []


# ----------------------------------------------------------------------------- the setup check
def check_cli(tmp_path: Path, *overrides: str):
    """``examples/run_grpo.py --config grpo_mixed_replay_turn.yaml --check`` with the setting at its default."""
    import subprocess
    import sys

    marker = new_marker()
    dirs = cm.RunDirs(tmp_path)
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "run_grpo.py"), "--config", ONE_REPLICA, "--check",
                           *dirs.overrides(), *overrides], cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=run_env(marker=marker))
    assert not dirs.logs.exists() and not dirs.ckpt.exists()  # a check writes no run directory
    from testkit.run_harness import wait_for_no_processes

    assert wait_for_no_processes(marker) == []
    table = {cells[1].strip(): [c.strip() for c in cells]
             for cells in (line.strip("|").split("|") for line in proc.stdout.splitlines()
                           if line.startswith("| nemo_gym/"))}
    return proc, table


def test_check_with_the_setting_false_passes_when_every_restart_only_server_is_replayable(tmp_path):
    proc, table = check_cli(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "allow_restart_only_gym_servers: false" in proc.stdout
    assert table["python_sandbox"][3] == "replayed" and table["workplace_restart_only_agent"][3] == "replayed"
    for server in ("workplace_restart_only_agent", "sandbox_simple_agent", "python_sandbox"):
        assert table[server][6].startswith("replayed: the rollouts of"), table[server]
    assert table["workplace_simple_agent"][6] == "saved at turn level", table["workplace_simple_agent"]
    assert "setup check: passed" in proc.stdout


def test_check_with_one_server_not_replayable_names_only_it(tmp_path):
    proc, table = check_cli(tmp_path, "++env.nemo_gym.config.python_sandbox.resources_servers.python_sandbox"
                                      ".replayable=false")
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1, proc.stderr[-3000:]
    assert "resources server 'python_sandbox' (on nemo_gym/replica-0)" in error[0], error
    assert "workplace_restart_only_agent" not in error[0] and "'workplace_assistant'" not in error[0], error
    assert "{sandbox_simple_agent: sibling}" in error[0] and "declare them replayable" in error[0], error
    assert table["python_sandbox"][3] == "restart-only" and table["workplace_restart_only_agent"][3] == "replayed"
    assert "setup check: FAILED" in proc.stdout


# ----------------------------------------------------------------------------- prefix level
@pytest.mark.alone  # CPU-bound (the torch worker decodes): shares no core under xdist
def test_prefix_level_a_replayed_rollouts_call_in_flight_continues_from_its_cut(tmp_path):
    """``target_level: prefix`` on the one-replica replay config with a Llama from a directory on the torch
    worker (every call decodes to its token limit; the decode hold keeps each batch in flight until two
    snapshots pinned it). A random model calls no tool: each rollout is one call, so a replayed rollout in
    flight has no finished call and its call's cut. SIGKILL once the newest committed snapshot holds a cut of
    a replayed rollout; the same command then continues those rollouts by replay (zero calls) with their call
    from its cut: same call id and token count, once; none restarts from its prompt."""
    from tests.functional.test_prefix_recovery import MAX_NEW, _saved_cuts, assert_held, held_env
    from tests.model_fixtures import llama_dir

    model = llama_dir(tmp_path / "my-llama")
    rows = one_replica_rows()
    data = write_rows(tmp_path / "train.jsonl", rows)
    dirs = cm.RunDirs(tmp_path / "run")
    args = ["--config", ONE_REPLICA, *dirs.overrides(), f"policy.model_name={model}", "logger.plot=false",
            "rollout_recovery.target_level=prefix", "rollout_recovery.allow_restart_only_gym_servers=true",
            "policy.generation.ignore_eos=true", f"data.train_data_path={data}", "data.shuffle=false",
            "grpo.max_num_steps=1", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2",
            "grpo.val_period=0", "grpo.val_at_start=false",
            "rollout_checkpointing.snapshot_attempt_interval_s=0.1", "rollout_checkpointing.keep_latest_k=50"]
    seen = SnapshotsSeen(dirs)

    def replayed_cut(_elapsed: float) -> bool:
        paths = seen.poll()
        if not paths:
            return False
        try:
            index = json.loads((Path(paths[-1]) / "gym_checkpoint.json").read_text())
        except FileNotFoundError:
            return False
        return any(set(keys) & set(index.get("cut_tokens", {}).get(iid, {}))
                   for iid, keys in index.get("replayed", {}).items())

    dirs.root.mkdir(parents=True)
    first = run_once(args, env=held_env(), kill_when=replayed_cut, timeout_s=400,
                     stdout_path=dirs.root / "run-1.out", stderr_path=dirs.root / "run-1.err")
    assert first.killed_by == "group", first.tail(30)
    assert_held(dirs.logs)
    seen.poll()
    cuts = {path: _saved_cuts(Path(path)) for path in seen.replayed if Path(path).is_dir()}
    second = run_once(args, env=run_env(marker=new_marker()), timeout_s=400,
                      stdout_path=dirs.root / "run-2.out", stderr_path=dirs.root / "run-2.err")
    assert second.returncode == 0, second.tail(40)
    assert not first.leftover and not second.leftover

    restore = dirs.restore_record()
    saved = {k for keys in seen.replayed[restore["snapshot"]].values() for k in keys}
    saved_cuts = {k: c for k, c in cuts[restore["snapshot"]].items() if k in saved}
    assert saved_cuts, "the restored snapshot holds no cut of a replayed rollout"
    assert {base_key(k) for k in restore["replayed_rollout_ids"]} == saved, restore
    assert restore["restored_replay"] == len(saved) and restore["restarted_from_prompt"] == 0, restore
    # each replayed rollout's cut continues in its next attempt's call 0, once, from the same tokens
    prefix = restore["restored_prefix_tokens"]
    assert {base_key(k): n for k, n in prefix.items() if base_key(k) in saved} == \
        {k: c.token_count for k, c in saved_cuts.items()}, (prefix, saved_cuts)
    continued = [c for r in step_rows(dirs) for c in r.get("prefix_continuations", [])]
    for key, cut in saved_cuts.items():
        uses = [c for c in continued if c["call_id"] == cut.call_id]
        assert len(uses) == 1 and uses[0]["rollout_id"] == f"{key}-a1", (key, uses)
        assert (uses[0]["call"], uses[0]["token_count"], uses[0]["discarded"]) == (0, cut.token_count, None)
        assert uses[0]["generation_tokens"] == MAX_NEW
    groups = [g for r in step_rows(dirs) for g in r["groups"]]
    assert sorted(groups) == sorted(set(groups)) and len(groups) == 4
    # replayed with no recorded call, each still counts as a rollout that came back by replay
    counted = [(r.get("replay_rollouts", 0), r.get("replay_calls_replayed", 0)) for r in step_rows(dirs)]
    assert sum(n for n, _ in counted) == len(saved) and sum(c for _, c in counted) == 0, counted
