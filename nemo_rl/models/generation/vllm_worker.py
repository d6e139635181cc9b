"""The vLLM generation backend (``policy.generation.backend: vllm``): a Ray actor running vLLM.

The actor starts vLLM's own OpenAI-compatible server (its async engine, the
``/v1/chat/completions`` route with automatic tool choice and the ``hermes``
tool parser, as ``policy.generation.vllm_cfg`` says) in a child process on a
private loopback port, and serves a thin front on the run's policy port:

* ``POST /v1/chat/completions``: the request's messages are normalised the way
  the torch worker's chat template expects (``nemo_rl.models.chat``), then sent
  to vLLM with ``logprobs``, ``return_token_ids`` and
  ``skip_special_tokens: false`` (the hermes markers are special tokens of the
  tiny model). vLLM's reply goes back as is (its 4xx errors too), plus the
  fields Gym's model server passes through for training: ``prompt_token_ids``,
  ``generation_token_ids``, ``generation_log_probs`` (vLLM's logprob of each
  sampled token, after temperature: ``--logprobs-mode processed_logprobs``)
  and ``weight_version``.
* ``GET /v1/models``, ``GET /health``.

Refit (``refit(weights, version)``) with requests in flight: the trainer's
state dict is written as safetensors first; then new requests wait at a gate,
vLLM's scheduler is paused in ``keep`` mode (``/pause?mode=keep&clear_cache=false``:
requests in flight stay scheduled with their KV cache, none is aborted or
recomputed), the file is loaded in vLLM's worker through ``/collective_rpc`` by
``VllmRefitExtension`` (``vllm_extension.py``: verifies every parameter was
written), the version bumps, vLLM resumes and the gate opens. A request in
flight continues on the new weights; its ``weight_version`` is the one serving
when it was sent to vLLM (the oldest that can have produced any of its
tokens). ``clear_cache=false`` matters: vLLM 0.32 honours ``clear_cache`` in
keep mode and would preempt every running request to recompute it.

The prefix cache is not reset: vLLM refuses the reset while any request holds
KV blocks (``{"success": false}``), which is exactly the keep-mode case.
Instead every request's ``cache_salt`` names the weight version it is sent at,
so a request sent after a refit never reuses prefix blocks computed under
older weights (those are unreachable to it, and evicted as any free block). The refit is
checked for real every step by the trainer's ``gen_logprob_abs_err`` (vLLM's
logprobs against the trainer's recomputed ones, on-policy replies only).
"""

from __future__ import annotations

import asyncio
import ctypes
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from aiohttp import ClientSession, ClientTimeout, web

from nemo_rl.algorithms.grpo_config import PolicyConfig
from nemo_rl.models.chat import template_messages, template_tools
from nemo_rl.models.generation.http_front import serve_openai_routes
from nemo_rl.models.generation.protocol import error_body

EXTENSION_CLS = "nemo_rl.models.generation.vllm_extension.VllmRefitExtension"


def vllm_available() -> str | None:
    """None when vLLM can be imported here, else why not."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM"
        return f"vllm is not importable: {type(e).__name__}: {e}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the actor process dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _state_dict(weights: Any) -> dict:
    import torch

    if isinstance(weights, (bytes, bytearray, memoryview)):
        weights = torch.load(io.BytesIO(bytes(weights)), map_location="cpu", weights_only=True)
    if not isinstance(weights, dict):
        raise TypeError(f"refit expects a state dict or its torch.save bytes, got {type(weights).__name__}")
    return weights


def _write_safetensors(weights: Any, path: Path) -> None:
    from safetensors.torch import save_file

    # clone: tied tensors share storage, which safetensors refuses
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in _state_dict(weights).items()}
    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp))
    os.replace(tmp, path)


def _as_json_arguments(messages: list[dict]) -> list[dict]:
    """vLLM's request model wants tool-call ``arguments`` as JSON strings (it parses them for the template)."""
    for m in messages:
        for c in m.get("tool_calls") or []:
            if not isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"], ensure_ascii=False)
    return messages


def _versioned_salt(salt: Any, version: int) -> str:
    """The request's ``cache_salt`` (if any) plus its weight version: prefix blocks are reused within one version."""
    tag = f"nemo-rl-weights-v{version}"
    return f"{salt}.{tag}" if isinstance(salt, str) and salt else tag


class VllmGenerationServer:
    """Plain-Python implementation; ``VllmGenerationWorker`` is its Ray actor form.

    ``model`` is a local model directory or ``model_files(dir)`` (see the torch
    worker); ``weights`` (a state dict or its ``torch.save`` bytes) become the
    served model's weights.
    """

    def __init__(self, policy_cfg: PolicyConfig | dict, model: str | dict[str, bytes], weights: Any = None,
                 weight_version: int = 0, seed: int = 0, model_name: str | None = None):
        self.cfg = policy_cfg if isinstance(policy_cfg, PolicyConfig) else PolicyConfig.model_validate(policy_cfg)
        if self.cfg.generation.backend != "vllm":
            raise ValueError(f"policy.generation.backend={self.cfg.generation.backend!r}: this is the vllm backend")
        self.model_name = model_name or self.cfg.model_name
        self._dir = Path(tempfile.mkdtemp(prefix="nemo_rl_vllm_model_"))
        if isinstance(model, dict):
            for name, data in model.items():
                if "/" in name or name.startswith("."):
                    raise ValueError(f"model file name {name!r} is not a plain file name")
                (self._dir / name).write_bytes(data)
        else:
            for f in Path(model).iterdir():
                if f.is_file() and not f.name.endswith((".pt", ".pth")):
                    shutil.copy2(f, self._dir / f.name)
        if weights is not None:
            for f in self._dir.glob("*.safetensors*"):
                f.unlink()
            (self._dir / "model.safetensors.index.json").unlink(missing_ok=True)
            _write_safetensors(weights, self._dir / "model.safetensors")
        elif not any(self._dir.glob("*.safetensors")):
            raise ValueError("VllmGenerationServer: no weights given and none in the model directory")
        self._seed = int(seed)
        self._version = int(weight_version)
        self._proc: subprocess.Popen | None = None
        self._vllm_url: str | None = None
        self._session: ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.base_url: str | None = None
        self._gate = asyncio.Event()
        self._gate.set()
        self._inflight = 0
        self._refit_lock = asyncio.Lock()
        self.created = int(time.time())
        self.stats: dict[str, Any] = {"requests": 0, "refits": 0, "refits_in_flight": 0, "load_s": None,
                                      "refit_s": []}

    # ----- lifecycle -----------------------------------------------------
    def _vllm_command(self, port: int) -> list[str]:
        v = self.cfg.generation.vllm_cfg
        max_len = v.max_model_len or self.cfg.max_seq_len
        try:
            cfg = json.loads((self._dir / "config.json").read_text())
            max_len = min(max_len, int(cfg.get("max_position_embeddings") or max_len))
        except (OSError, ValueError):
            pass
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self._dir), "--served-model-name", self.model_name,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", self.cfg.dtype,
               "--max-model-len", str(max_len), "--max-num-seqs", str(v.max_num_seqs),
               "--gpu-memory-utilization", str(v.gpu_memory_utilization), "--seed", str(self._seed),
               "--tensor-parallel-size", str(v.tensor_parallel_size),
               "--worker-extension-cls", EXTENSION_CLS, "--logprobs-mode", "processed_logprobs",
               "--generation-config", "vllm", "--disable-uvicorn-access-log"]
        if v.enforce_eager:
            cmd.append("--enforce-eager")
        kw = v.http_server_serving_chat_kwargs
        if kw.get("enable_auto_tools"):
            cmd.append("--enable-auto-tool-choice")
        if kw.get("tool_parser"):
            cmd += ["--tool-call-parser", str(kw["tool_parser"])]
        return cmd

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start vLLM's server and the front; returns the front's base URL ending in ``/v1``."""
        if self._runner is not None:
            return self.base_url
        t0 = time.monotonic()
        vport = _free_port()
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache on the private port
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        repo_root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
        self._log_path = self._dir / "vllm_server.log"
        log = open(self._log_path, "wb")
        self._proc = subprocess.Popen(self._vllm_command(vport), env=env, stdout=log, stderr=subprocess.STDOUT,
                                      preexec_fn=_die_with_parent)
        log.close()
        self._vllm_url = f"http://127.0.0.1:{vport}"
        self._session = ClientSession(timeout=ClientTimeout(total=None))
        deadline = t0 + self.cfg.generation.vllm_cfg.startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self._proc.returncode} while starting:\n"
                                   f"{self.server_log_tail()}")
            try:
                async with self._session.get(self._vllm_url + "/health", timeout=ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                await self.stop()
                raise TimeoutError(f"vLLM server not healthy after {self.cfg.generation.vllm_cfg.startup_timeout_s}"
                                   f" s:\n{self.server_log_tail()}")
            await asyncio.sleep(0.5)
        self.stats["load_s"] = round(time.monotonic() - t0, 2)
        self._runner, self.base_url = await serve_openai_routes(
            host, port, chat=self._handle_chat, models=self._handle_models, health=self._handle_health)
        return self.base_url

    def server_log_tail(self, n: int = 4000) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            for _ in range(100):
                if self._proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            else:
                self._proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ----- weights -------------------------------------------------------
    async def _rpc(self, method: str, *args: str) -> Any:
        async with self._session.post(self._vllm_url + "/collective_rpc",
                                      json={"method": method, "args": list(args)}) as r:
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"vLLM collective_rpc {method} failed ({r.status}): {text[-2000:]}")
        return json.loads(text)["results"] if text else None

    async def _vllm_post(self, route: str, **params: str) -> dict:
        """POST a dev route of vLLM's private server (query ``params``); a non-200 raises, naming it."""
        async with self._session.post(self._vllm_url + route, params=params) as r:
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"vLLM {route} on {self._vllm_url} failed ({r.status}): {text[-2000:]}")
        return json.loads(text) if text else {}

    async def refit(self, weights: Any, weight_version: int) -> dict:
        """Load new weights without waiting for requests in flight (they keep going on the new ones).

        Returns ``{weight_version, refit_s, in_flight, written, params}``; ``in_flight`` is how many
        requests were in flight when vLLM paused.
        """
        if not isinstance(weight_version, int) or weight_version < 0:
            raise ValueError(f"weight_version must be a non-negative int, got {weight_version!r}")
        async with self._refit_lock:
            t0 = time.monotonic()
            path = self._dir / "refit.safetensors"
            try:
                # Written before the pause: generation stops only while the weights load.
                await asyncio.get_running_loop().run_in_executor(None, _write_safetensors, weights, path)
                self._gate.clear()
                in_flight = self._inflight  # read with the gate closing: these were sent at the old version
                try:
                    await self._vllm_post("/pause", mode="keep", clear_cache="false")
                    try:
                        results = await self._rpc("nemo_rl_load_weights", str(path))
                    except BaseException as e:  # requests in flight must not hang paused; the load's error wins
                        try:
                            await self._vllm_post("/resume")
                        except Exception as resume_error:  # noqa: BLE001 - e.g. vLLM died of the failed load
                            e.add_note(f"resuming vLLM after the failed load failed too: {resume_error!r}")
                        raise
                    self._version = int(weight_version)
                    await self._vllm_post("/resume")
                finally:
                    self._gate.set()
            finally:
                path.unlink(missing_ok=True)
            dt = time.monotonic() - t0
            self.stats["refits"] += 1
            self.stats["refits_in_flight"] += int(in_flight > 0)
            self.stats["refit_s"].append(round(dt, 4))
            first = results[0] if results else {}
            return {"weight_version": self._version, "refit_s": dt, "in_flight": in_flight, **first}

    async def weight_version(self) -> int:
        return self._version

    async def weight_sums(self) -> dict:
        return (await self._rpc("nemo_rl_weight_sums"))[0]

    async def get_stats(self) -> dict:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.stats.items()}

    # ----- HTTP ----------------------------------------------------------
    async def _handle_models(self, request: web.Request) -> web.Response:
        async with self._session.get(self._vllm_url + "/v1/models") as r:
            return web.json_response(await r.json(), status=r.status)

    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": self._proc is not None and self._proc.poll() is None,
                                  "weight_version": self._version})

    def _vllm_body(self, body: dict) -> dict:
        if body.get("stream"):
            raise ValueError("stream: streaming is not supported by this backend")
        try:
            messages = _as_json_arguments(template_messages(body.get("messages")))
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith("messages") else f"messages: {e}") from None
        out = dict(body)
        out["messages"] = messages
        if body.get("tools"):
            out["tools"] = template_tools(body["tools"])
        out["model"] = self.model_name
        gen = self.cfg.generation
        if out.get("temperature") is None:
            out["temperature"] = gen.temperature
        if out.get("max_tokens") is None and out.get("max_completion_tokens") is None:
            out["max_tokens"] = gen.max_new_tokens
        out["logprobs"] = True
        out["return_token_ids"] = True
        out["skip_special_tokens"] = False
        if body.get("n") not in (None, 1):
            raise ValueError("n: only n=1 is supported (Gym asks for one choice per call)")
        return out

    async def _handle_chat(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001
            return web.json_response(error_body("request body is not valid JSON", "body"), status=400)
        if not isinstance(body, dict):
            return web.json_response(error_body("request body must be a JSON object", "body"), status=400)
        try:
            vbody = self._vllm_body(body)
        except ValueError as e:
            msg = str(e)
            return web.json_response(error_body(msg, msg.split(":")[0]), status=400)
        self.stats["requests"] += 1
        while not self._gate.is_set():
            await self._gate.wait()
        self._inflight += 1
        try:
            version = self._version
            vbody["cache_salt"] = _versioned_salt(body.get("cache_salt"), version)
            async with self._session.post(self._vllm_url + "/v1/chat/completions", json=vbody) as r:
                status, reply = r.status, await r.json(content_type=None)
        finally:
            self._inflight -= 1
        if status != 200:
            return web.json_response(reply, status=status)
        return web.json_response(self._with_token_fields(reply, version, bool(body.get("logprobs"))))

    def _with_token_fields(self, reply: dict, version: int, wanted_logprobs: bool) -> dict:
        choice = reply["choices"][0]
        gen = list(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or []
        lps = [float(c["logprob"]) for c in content]
        if len(lps) != len(gen):
            raise RuntimeError(f"vLLM returned {len(gen)} token ids but {len(lps)} logprobs")
        lps = [max(lp, -9999.0) for lp in lps]
        reply["model"] = self.model_name
        reply["prompt_token_ids"] = list(reply.get("prompt_token_ids") or [])
        reply["generation_token_ids"] = gen
        reply["generation_log_probs"] = lps
        reply["weight_version"] = version
        if not wanted_logprobs:
            choice["logprobs"] = None
        return reply


# The Ray actor. Size it with .options(num_cpus=..., num_gpus=...) at creation.
VllmGenerationWorker = ray.remote(VllmGenerationServer)
