"""``python -m gym_patches.launch``: prints the servers and stops every process on Ctrl-C or SIGTERM; a Gym
YAML or a NeMo-RL training config."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.functional
REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def test_launch_prints_servers_and_ctrl_c_stops_them(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_patches.launch", "--config", "examples/gym_configs/mixed_replayed.yaml",
         "--log-dir", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    deadline = time.monotonic() + 150
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if line.startswith("sandbox_simple_agent"):
                break
        table = {l.split()[0]: l.split() for l in lines if l and l.split()[0] in {
            "policy_model", "workplace_assistant", "python_sandbox", "workplace_simple_agent",
            "workplace_restart_only_agent", "sandbox_simple_agent"}}
        assert set(table) == {"policy_model", "workplace_assistant", "python_sandbox", "workplace_simple_agent",
                              "workplace_restart_only_agent", "sandbox_simple_agent"}, lines
        assert table["workplace_restart_only_agent"][1:2] == ["agent"]
        mode = {name: " ".join(row[3:]) for name, row in table.items()}  # the last column (may hold spaces)
        assert mode["workplace_restart_only_agent"] == "replayed"  # restart-only, declared replayable
        assert mode["python_sandbox"] == "replayed"
        assert mode["workplace_assistant"] == "saves, replayable"
        assert mode["workplace_simple_agent"] == "saves, replayable"
        assert all(row[2].startswith("http://127.0.0.1:") for row in table.values())
        servers = [pid for pid in _children(proc.pid) if "gym_patches.server_main" in
                   Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
        assert len(servers) == 7, servers  # head + six servers
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert not [pid for pid in servers if _alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_right_after_start_still_stops_cleanly(tmp_path, inherited):
    """A Ctrl-C that lands while the server table is being printed (the first line is out) is a clean
    stop too: exit 0 and no server left, never a KeyboardInterrupt traceback. Also when the launcher
    was started with SIGINT ignored, as a background job of a non-interactive shell is."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_patches.launch", "--config", "examples/gym_configs/mixed_replayed.yaml",
         "--log-dir", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_ignore_sigint if inherited == "ignored" else None,
    )
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "the launcher exited before printing its servers"
            if line.startswith("head server:"):
                servers = [pid for pid in _children(proc.pid) if "gym_patches.server_main" in
                           Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.stdout.read()
        assert proc.wait(timeout=30) == 0, rest
        assert "Traceback" not in rest and "stopping Gym servers" in rest
        assert len(servers) == 7 and not [pid for pid in servers if _alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_launch_names_a_bad_config_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("agent:\n  responses_api_agents:\n    simple_agent:\n      max_stepz: 3\n"
                   "      model_server: {type: responses_api_models, name: nope}\n")
    proc = subprocess.run([sys.executable, "-m", "gym_patches.launch", "--config", str(bad)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "agent.model_server refers to responses_api_models/nope" in proc.stderr


def test_launch_names_an_unknown_server_key_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pm:\n  responses_api_models:\n    vllm_model:\n      return_token_id_informaton: true\n")
    proc = subprocess.run([sys.executable, "-m", "gym_patches.launch", "--config", str(bad), "--log-dir",
                           str(tmp_path / "logs")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "pm.responses_api_models.vllm_model: return_token_id_informaton: Extra inputs are not permitted" in proc.stderr
    assert not (tmp_path / "logs").exists()  # no process was started


def test_head_server_does_not_publish_the_control_token(tmp_path):
    import urllib.request

    from gym_patches.launch import GymDeployment

    cfg = {"checkpoint": {"enabled": True, "control_auth_token": "s3cret-token-value"},
           "pm": {"responses_api_models": {"vllm_model": {}}}}
    with GymDeployment.start(cfg, log_dir=tmp_path) as dep:
        text = urllib.request.urlopen(dep.head_url + "/global_config_dict_yaml", timeout=10).read().decode()
    assert "s3cret-token-value" not in text and "<redacted>" in text


def test_an_rl_config_starts_the_gym_its_run_would_start_and_sigterm_stops_it(tmp_path):
    """The launcher on a shipped training config (``defaults:`` inheritance, a shard of two replicas):
    every replica's servers answer their checkpoint status route with the token the launcher wrote,
    and SIGTERM stops every process it started."""
    import json
    import urllib.request

    rl = "examples/configs/grpo_workplace_two_replicas_turn.yaml"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_patches.launch", "--config", rl, "--log-dir", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    servers = ("policy_model", "workplace_assistant", "workplace_simple_agent")
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and sum(l.startswith("workplace_simple_agent") for l in lines) < 2:
            line = proc.stdout.readline()
            assert line, f"the launcher exited early: {lines}"
            lines.append(line.rstrip())
        assert lines[0].startswith(f"RL config {rl}: its env.nemo_gym section, rollout_recovery.target_level=turn "
                                   "(Gym checkpoints enabled); 2 Gym instance(s)"), lines
        instances = [l.split()[0] for l in lines if "head server: http://127.0.0.1:" in l]
        assert instances == ["nemo_gym/replica-0", "nemo_gym/replica-1"], lines
        token = (tmp_path / "control_token").read_text().strip()
        assert oct((tmp_path / "control_token").stat().st_mode & 0o777) == "0o600"
        urls = [l.split()[2] for l in lines if l.split() and l.split()[0] in servers]
        assert len(urls) == 6 and len(set(urls)) == 6, lines
        for url in urls:
            request = urllib.request.Request(url + "/ng-control/v1/checkpoint/status",
                                             headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=10) as resp:
                status = json.loads(resp.read())
            assert resp.status == 200 and status["kind"] in ("model", "resources", "agent"), status
        started = [pid for pid in _children(proc.pid) if "gym_patches.server_main" in
                   Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
        assert len(started) == 8, started  # per replica: head + three servers
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 0, rest
        assert "stopping Gym servers (SIGTERM)" in rest and "Traceback" not in rest
        assert not [pid for pid in started if _alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_overrides_apply_to_an_rl_config_only(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gym_patches.launch", "--config", "examples/gym_configs/mixed.yaml",
                           "env.nemo_gym.spinup_timeout_s=5", "--log-dir", str(tmp_path / "logs")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "only an RL config takes key=value overrides" in proc.stderr
    assert not (tmp_path / "logs").exists()


def test_a_bad_key_in_an_rl_config_is_named_before_anything_starts(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gym_patches.launch", "--config",
                           "examples/configs/grpo_workplace_turn.yaml", "env.nemo_gym.config_path=[x.yaml]",
                           "--log-dir", str(tmp_path / "logs")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "did you mean 'env.nemo_gym.config_paths'?" in proc.stderr
    assert not (tmp_path / "logs").exists()
