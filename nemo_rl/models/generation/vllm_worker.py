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
* ``POST /v1/ng-cuts`` and ``/v1/ng-cuts/fetch``: generation cuts
  (``gym_patches.checkpoint.cuts``: pin the counts, fetch the tokens later). A
  chat request named by ``X-NG-Call-Id`` (or carrying ``ng_prefix``) is sent to
  vLLM with ``stream: true``: the front accumulates each chunk's ``token_ids``
  and logprobs as vLLM samples them, so a pin reads the tokens so far without
  touching the request in vLLM, and the reply is assembled from the chunks in
  the shape above (text decoded from the token ids, tool calls parsed from it by
  the hermes parser the torch worker uses, ``nemo_rl.models.chat.parse_reply``:
  vLLM's streamed tool-call deltas are not the whole text). A request sent with
  ``ng_prefix`` has its prompt rendered by vLLM's ``/tokenize`` (the chat
  route's renderer); when its digest is the cut's, decoding continues after the
  prefix on ``/v1/completions`` with the token ids as the prompt (streamed too,
  so a continued call can be cut again), else the cut is discarded. Requests
  without either stay on the plain, non-streaming path.
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
import contextlib
import ctypes
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import ray
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web
from pydantic import ValidationError

from gym_patches.utils.processes import free_port
from gym_patches.checkpoint.cuts import (
    CALL_ID_HEADER,
    CALL_INDEX_HEADER,
    PREFIX_FIELD,
    RESEND_HEADER,
    GenerationCut,
    prompt_digest,
)
from nemo_rl.models.generation.call_seeds import messages_key, offset_seed, parse_call_index, request_seed
from nemo_rl.models.chat import parse_reply, template_messages, template_tools
from nemo_rl.models.generation.continuation import Continuation, count_resend, init_stats, stats_now
from nemo_rl.models.generation.worker_log import redirect_output
from nemo_rl.models.generation.cut_pins import CutPins, LiveCall
from nemo_rl.models.generation.http_front import serve_openai_routes
from nemo_rl.models.generation.protocol import check_call_id, error_body
from nemo_rl.models.policy_config import PolicyConfig

EXTENSION_CLS = "nemo_rl.models.generation.vllm_extension.VllmRefitExtension"


def vllm_available() -> str | None:
    """None when vLLM can be imported here, else why not."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM"
        return f"vllm is not importable: {type(e).__name__}: {e}"
    return None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the actor process dies (Linux). vLLM stops on SIGTERM
    (``stop``), so it does not keep the run's block of stop signals (docs/design.md §5.11)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1})
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


# Sampling settings a continuation passes on from the chat request to ``/v1/completions``.
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")
# Chat-template settings ``/tokenize`` must get to render the prompt as the chat route does.
_TEMPLATE_KEYS = ("tools", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                  "chat_template_kwargs", "mm_processor_kwargs")


@dataclass
class _Streamed:
    """What one streamed vLLM request gave: its tokens (with chat-style logprob entries) and how it ended."""

    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    entries: list[dict] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    head: dict = field(default_factory=dict)  # the first chunk's id and created


def _logprob_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": max(float(logprob), -9999.0), "bytes": list(token.encode("utf-8"))}


def _completion_entries(logprobs: dict, top_k: int) -> list[dict]:
    """``/v1/completions`` logprobs (parallel lists) as chat-completions ``logprobs.content`` entries."""
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    out = []
    for token, lp, top in zip(tokens, values, tops):
        best = sorted((top or {}).items(), key=lambda kv: -kv[1])[:top_k] if top_k else []
        out.append({**_logprob_entry(token, -9999.0 if lp is None else lp),
                    "top_logprobs": [_logprob_entry(t, v) for t, v in best]})
    return out


class VllmGenerationServer:
    """Plain-Python implementation; ``VllmGenerationWorker`` is its Ray actor form.

    ``model`` is a local model directory or ``model_files(dir)`` (see the torch
    worker); ``weights`` (a state dict or its ``torch.save`` bytes) become the
    served model's weights.
    """

    extension_cls = EXTENSION_CLS  # vLLM's --worker-extension-cls: the refit's load, run in its workers

    def __init__(self, policy_cfg: PolicyConfig | dict, model: str | dict[str, bytes], weights: Any = None,
                 weight_version: int = 0, seed: int = 0, model_name: str | None = None, log_path: str | None = None,
                 deterministic: bool = False):
        """``deterministic`` (``grpo.deterministic``): each request is sent with vLLM's per-request ``seed``,
        derived as the torch worker derives it (``call_seeds``), a continuation after a cut with a seed of its
        own (``offset_seed``: vLLM draws from a generator, not by counter), and a refit waits for the requests
        in flight (a request's tokens all come from one version)."""
        if log_path is not None:  # the run's log dir names it when this worker is lost
            redirect_output(log_path)
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
        self.deterministic = bool(deterministic)
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
        self._tokenizer: Any = None  # loaded when a tracked call first needs it (decoding, stop tokens)
        self._tokenizer_lock = asyncio.Lock()
        self._stop_ids: frozenset[int] = frozenset()
        self.stats: dict[str, Any] = {"requests": 0, "refits": 0, "refits_in_flight": 0, "load_s": None,
                                      "refit_s": []}
        init_stats(self.stats)  # continued, continued_tokens, discarded
        self.cuts = CutPins(self.stats)  # calls named by X-NG-Call-Id, and their generation-cut pins

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
               "--worker-extension-cls", self.extension_cls, "--logprobs-mode", "processed_logprobs",
               "--generation-config", "vllm", "--disable-uvicorn-access-log"]
        if v.enforce_eager:
            cmd.append("--enforce-eager")
        kw = v.http_server_serving_chat_kwargs
        if kw.get("enable_auto_tools"):
            cmd.append("--enable-auto-tool-choice")
        if kw.get("tool_parser"):
            cmd += ["--tool-call-parser", str(kw["tool_parser"])]
        return cmd

    async def start(self, host: str = "127.0.0.1", port: int = 0, reuse_port: bool = False) -> str:
        """Start vLLM's server and the front; returns the front's base URL ending in ``/v1``."""
        if self._runner is not None:
            return self.base_url
        t0 = time.monotonic()
        vport = free_port()
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
        # No cap on open connections (aiohttp's default is 100 would cap vLLM's batch at 100 calls).
        self._session = ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=None))
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
            host, port, chat=self._handle_chat, models=self._handle_models, health=self._handle_health,
            cuts=self.cuts.routes, reuse_port=reuse_port)
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
                while self.deterministic and self._inflight:  # each request's tokens from one version
                    await asyncio.sleep(0.01)
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

    async def process(self) -> dict:
        """This worker's pid and Ray node: a restart waits until its process tree is gone."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    async def get_stats(self) -> dict:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in stats_now(self.stats).items()}

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
        if gen.ignore_eos or body.get("ignore_eos"):
            out["ignore_eos"] = True
        if body.get("n") not in (None, 1):
            raise ValueError("n: only n=1 is supported (Gym asks for one choice per call)")
        return out

    @contextlib.asynccontextmanager
    async def _sending(self) -> AsyncIterator[int]:
        """Past the refit gate and counted in flight while vLLM has the request; yields the version serving."""
        while not self._gate.is_set():
            await self._gate.wait()
        self._inflight += 1
        try:
            yield self._version
        finally:
            self._inflight -= 1

    async def _handle_chat(self, request: web.Request) -> web.Response:
        call_id = request.headers.get(CALL_ID_HEADER)
        bad_id = check_call_id(call_id)
        if bad_id is not None:
            return web.json_response(error_body(bad_id, CALL_ID_HEADER), status=400)
        try:
            call_index = parse_call_index(request.headers.get(CALL_INDEX_HEADER))
        except ValueError as e:
            return web.json_response(error_body(str(e), CALL_INDEX_HEADER), status=400)
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001
            return web.json_response(error_body("request body is not valid JSON", "body"), status=400)
        if not isinstance(body, dict):
            return web.json_response(error_body("request body must be a JSON object", "body"), status=400)
        cut = None
        raw_cut = body.pop(PREFIX_FIELD, None)
        if raw_cut is not None:
            try:
                cut = GenerationCut.model_validate(raw_cut)
            except ValidationError as e:
                err = e.errors()[0]
                loc = ".".join([PREFIX_FIELD, *(str(x) for x in err["loc"])])
                return web.json_response(error_body(f"{loc}: {err['msg']}", loc), status=400)
        try:
            vbody = self._vllm_body(body)
        except ValueError as e:
            msg = str(e)
            return web.json_response(error_body(msg, msg.split(":")[0]), status=400)
        self.stats["requests"] += 1
        if self.deterministic:
            vbody["seed"] = request_seed(self._seed, call_id, call_index, messages_key(vbody["messages"]))
        if call_id is None and cut is None:  # nothing can cut it or continue it: vLLM's plain reply
            async with self._sending() as version:
                vbody["cache_salt"] = _versioned_salt(body.get("cache_salt"), version)
                async with self._session.post(self._vllm_url + "/v1/chat/completions", json=vbody) as r:
                    status, reply = r.status, await r.json(content_type=None)
            if status != 200:
                return web.json_response(reply, status=status)
            return web.json_response(self._with_token_fields(reply, version, bool(body.get("logprobs"))))
        live = None if call_id is None else LiveCall()
        with self.cuts.tracking(call_id, live):
            status, reply = await self._tracked_chat(body, vbody, cut, live, call_id, request.headers.get(RESEND_HEADER))
        return web.json_response(reply, status=status)

    # ----- tracked calls: streamed, so a cut can read them ------------------
    def _load_tokenizer(self) -> None:
        from transformers import AutoConfig, GenerationConfig

        from nemo_rl.models.policy import load_tokenizer

        tok = load_tokenizer(str(self._dir))
        # vLLM's stop tokens: the tokenizer's EOS and the model's generation-config EOS ids (vLLM 0.32 reads
        # the model's generation config for them with --generation-config vllm too).
        try:
            gen_cfg = GenerationConfig.from_pretrained(str(self._dir))
        except OSError:
            gen_cfg = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(self._dir)))
        stops = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
        eos = gen_cfg.eos_token_id
        stops.update([int(eos)] if isinstance(eos, int) else [int(e) for e in eos or []])
        self._tokenizer, self._stop_ids = tok, frozenset(stops)

    async def _ensure_tokenizer(self) -> None:
        """Load it once: calls that arrive together wait for one load (transformers' lazy imports are not safe
        from several threads at once: a second thread saw ``cannot import name 'AutoConfig'``)."""
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                await asyncio.get_running_loop().run_in_executor(None, self._load_tokenizer)

    async def _tracked_chat(self, body: dict, vbody: dict, cut: GenerationCut | None, live: LiveCall | None,
                            call_id: str | None = None, resend: str | None = None) -> tuple[int, dict]:
        """A call a cut can read (``live``), decoded from its start or after ``cut``'s prefix when
        ``Continuation`` keeps it (else the cut is discarded and the call starts over)."""
        await self._ensure_tokenizer()
        plan = Continuation.of(cut)
        prompt_ids: list[int] = []
        max_model_len = 0
        if plan is not None and plan.kept:  # render the prompt as the chat route would, to check it
            status, rendered = await self._render_prompt(vbody)
            if status != 200:
                return status, rendered
            prompt_ids, max_model_len = list(rendered["tokens"]), int(rendered["max_model_len"])
            plan.check_prompt(prompt_ids)
        count_resend(self.stats, resend, call_id, plan)
        if plan is None or not plan.kept:
            return await self._fresh_chat(body, vbody, plan, live)
        return await self._continued_chat(body, vbody, plan, live, prompt_ids, max_model_len)

    async def _render_prompt(self, vbody: dict) -> tuple[int, Any]:
        """vLLM's ``/tokenize`` of the request's prompt, rendered as its chat route would: ``(200, its reply)``
        (``tokens``, ``max_model_len``), or vLLM's error ``(status, body)``."""
        tbody = {"model": self.model_name, "messages": vbody["messages"]}
        tbody.update({k: vbody[k] for k in _TEMPLATE_KEYS if vbody.get(k) is not None})
        async with self._session.post(self._vllm_url + "/tokenize", json=tbody) as r:
            return r.status, await r.json(content_type=None)

    async def _fresh_chat(self, body: dict, vbody: dict, plan: Continuation | None,
                          live: LiveCall | None) -> tuple[int, dict]:
        """The call decoded from its start on vLLM's chat route, streamed; a discarded ``plan`` (if any) says
        so in the reply's ``prefix_continuation`` (docs/design.md §5.10)."""
        async with self._sending() as version:
            # include_reasoning: with a tool parser, vLLM leaves token ids and logprobs out of the chunks
            # of a request that hides reasoning
            sbody = {**vbody, "stream": True, "stream_options": {"include_usage": True},
                     "include_reasoning": True, "cache_salt": _versioned_salt(body.get("cache_salt"), version)}
            if live is not None:
                live.version = version
            status, out = await self._stream("/v1/chat/completions", sbody, live, top_k=0)
        if status != 200:
            return status, out
        reply = self._chat_reply(body, out.head, out.prompt_ids or [], out.ids, out.lps, out.entries,
                                 out.finish_reason, out.stop_reason, version)
        if plan is not None:
            reply["prefix_continuation"] = plan.reply(self.stats).model_dump()
        return 200, reply

    async def _continued_chat(self, body: dict, vbody: dict, plan: Continuation, live: LiveCall | None,
                              prompt_ids: list[int], max_model_len: int) -> tuple[int, dict]:
        """The call continued after ``plan``'s kept prefix: the rest decoded by ``_decode_tail`` unless the
        prefix already ends the reply; the reply holds prefix + tail (docs/design.md §5.10)."""
        ids, lps = plan.ids, plan.lps
        plan.follow(live)
        ignore_eos = bool(vbody.get("ignore_eos"))
        max_new = vbody.get("max_completion_tokens") or vbody["max_tokens"]
        budget = plan.budget(max_new, max_model_len, len(prompt_ids))
        finish = plan.finish_reason(self._stop_ids, ignore_eos, budget)
        sent_at = None
        if finish is not None:  # the cut already holds the whole reply: nothing to decode
            out = _Streamed(finish_reason=finish)
        else:
            if self.deterministic:  # reproducible for this cut (vLLM cannot skip its generator to token len(ids))
                vbody = {**vbody, "seed": offset_seed(vbody["seed"], len(ids))}
            status, out, sent_at = await self._decode_tail(body, vbody, live, prompt_ids + ids, budget, ignore_eos)
            if status != 200:
                return status, out
        continuation = plan.reply(self.stats)
        reply = self._chat_reply(body, {}, prompt_ids, ids + out.ids, lps + out.lps,
                                 self._prefix_entries(ids, lps) + out.entries,
                                 out.finish_reason, out.stop_reason, plan.weight_version(sent_at))
        reply["prefix_continuation"] = continuation.model_dump()
        return 200, reply

    async def _decode_tail(self, body: dict, vbody: dict, live: LiveCall | None, prompt: list[int], budget: int,
                           ignore_eos: bool) -> tuple[int, Any, int]:
        """Decode after a kept prefix on ``/v1/completions`` with ``prompt`` (the prompt's and prefix's token
        ids) as the prompt, streamed so the continued call can be cut again: ``(200, _Streamed, the version it
        was sent at)``, or vLLM's error ``(status, body, version)``."""
        top_k = int(vbody.get("top_logprobs") or 0) if vbody.get("logprobs") else 0
        async with self._sending() as sent_at:
            cbody = {"model": self.model_name, "prompt": prompt, "max_tokens": budget,
                     "logprobs": top_k, "return_token_ids": True, "skip_special_tokens": False,
                     "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True},
                     "cache_salt": _versioned_salt(body.get("cache_salt"), sent_at)}
            cbody.update({k: vbody[k] for k in _SAMPLING_KEYS if vbody.get(k) is not None})
            if live is not None:
                live.version = sent_at
            status, out = await self._stream("/v1/completions", cbody, live, top_k=top_k)
        return status, out, sent_at

    def _prefix_entries(self, ids: list[int], lps: list[float]) -> list[dict]:
        """Chat-style logprob entries of a kept prefix's tokens (each decoded alone; no top logprobs)."""
        tok = self._tokenizer
        return [{**_logprob_entry(tok.decode([t], skip_special_tokens=False), lp), "top_logprobs": []}
                for t, lp in zip(ids, lps)]

    async def _stream(self, route: str, vbody: dict, live: LiveCall | None,
                      top_k: int) -> tuple[int, Any]:
        """POST a streaming request to vLLM and gather its chunks: ``(200, _Streamed)``, or vLLM's error
        ``(status, body)``. The tokens land in ``live``'s lists as each chunk arrives (a cut reads them)."""
        out = _Streamed()
        if live is not None:
            out.ids, out.lps = live.ids, live.lps
        chat = route.endswith("/chat/completions")
        async with self._session.post(self._vllm_url + route, json=vbody) as r:
            if r.status != 200:
                return r.status, await r.json(content_type=None)
            buf = b""
            async for data in r.content.iter_any():
                buf += data
                while (end := buf.find(b"\n\n")) >= 0:
                    event, buf = buf[:end], buf[end + 2:]
                    for line in event.split(b"\n"):
                        payload = line[5:].strip() if line.startswith(b"data:") else b""
                        if not payload or payload == b"[DONE]":
                            continue
                        chunk = json.loads(payload)
                        if "error" in chunk:  # vLLM failed mid-stream
                            err = chunk["error"]
                            code = err.get("code") if isinstance(err, dict) else None
                            return (code if isinstance(code, int) and 400 <= code < 600 else 500), chunk
                        self._take_chunk(out, chunk, live, chat, top_k)
        return 200, out

    @staticmethod
    def _take_chunk(out: _Streamed, chunk: dict, live: LiveCall | None, chat: bool, top_k: int) -> None:
        """One streamed chunk into ``out`` (and so into ``live``): the prompt's ids first, then the tokens."""
        choices = chunk.get("choices") or []
        if not out.head:
            out.head = {"id": chunk.get("id"), "created": chunk.get("created")}
        if out.prompt_ids is None:  # chat: on the first chunk; completions: on its first choice
            prompt = chunk.get("prompt_token_ids")
            for choice in choices:
                prompt = prompt if prompt is not None else choice.get("prompt_token_ids")
            if prompt is not None:
                out.prompt_ids = list(prompt)
                if live is not None and live.prompt_sha is None:
                    live.prompt_sha = prompt_digest(out.prompt_ids)
        for choice in choices:
            ids = list(choice.get("token_ids") or [])
            logprobs = choice.get("logprobs") or {}
            entries = (logprobs.get("content") or []) if chat else _completion_entries(logprobs, top_k)
            if len(entries) != len(ids):
                raise RuntimeError(f"vLLM streamed {len(ids)} token ids but {len(entries)} logprobs in a chunk")
            out.entries.extend(entries)
            out.lps.extend(max(float(e["logprob"]), -9999.0) for e in entries)
            out.ids.extend(ids)
            if choice.get("finish_reason") is not None:
                out.finish_reason, out.stop_reason = choice["finish_reason"], choice.get("stop_reason")

    def _chat_reply(self, body: dict, head: dict, prompt_ids: list[int], gen: list[int], lps: list[float],
                    entries: list[dict], finish: str | None, stop_reason: Any, version: int) -> dict:
        """A chat.completion in the shape of vLLM's own (plus the token fields), from streamed tokens."""
        text_ids = gen[:-1] if finish == "stop" and gen and gen[-1] in self._stop_ids else gen
        text = self._tokenizer.decode(text_ids, skip_special_tokens=False)
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        content, tool_calls = parse_reply(text, tools)
        finish = finish or "stop"
        if tool_calls and finish == "stop":
            finish = "tool_calls"
        elif not tool_calls and finish == "tool_calls":
            finish = "stop"
        return {
            "id": head.get("id") or "chatcmpl-" + uuid.uuid4().hex,
            "object": "chat.completion",
            "created": head.get("created") or int(time.time()),
            "model": self.model_name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": tool_calls},
                "logprobs": {"content": entries} if body.get("logprobs") else None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": list(gen),
            }],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen),
                      "total_tokens": len(prompt_ids) + len(gen)},
            "prompt_token_ids": list(prompt_ids),
            "generation_token_ids": list(gen),
            "generation_log_probs": list(lps),
            "weight_version": version,
        }

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
