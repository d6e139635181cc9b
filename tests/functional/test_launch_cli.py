"""``python -m gym_patches.launch``: prints the servers and stops every process on Ctrl-C."""

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
        [sys.executable, "-m", "gym_patches.launch", "--config", "examples/gym_configs/mixed.yaml",
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
        assert table["workplace_restart_only_agent"][-1] == "restart-only"
        assert table["python_sandbox"][-1] == "restart-only"
        assert table["workplace_assistant"][-1] == "saves"
        assert table["workplace_simple_agent"][-1] == "saves"
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
        [sys.executable, "-m", "gym_patches.launch", "--config", "examples/gym_configs/mixed.yaml",
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


def test_an_rl_config_is_refused_with_the_check_command(tmp_path):
    """A training config given to the Gym launcher by mistake starts nothing and says what to run."""
    rl = "examples/configs/grpo_mixed_turn.yaml"
    proc = subprocess.run([sys.executable, "-m", "gym_patches.launch", "--config", rl, "--log-dir",
                           str(tmp_path / "logs")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "is a NeMo-RL training config" in proc.stderr and f"run_grpo.py --config {rl} --check" in proc.stderr
    assert "head server" not in proc.stdout and not (tmp_path / "logs").exists()
