"""The torch generation worker: a Ray actor serving OpenAI-style chat completions.

The actor owns its own copy of the policy and an aiohttp server on its event
loop. Requests are queued and decoded in small batches (requests that arrive
within ``generation.batch_window_ms`` share one ``sample_batch``) on a single
executor thread, so the event loop stays responsive. Refits run on that thread
too: between batches when none decodes, else at the next decode step boundary
(``sample_batch``'s ``between_steps``), in place, so requests in flight keep
their KV cache and carry on with the new weights instead of waiting for or
restarting the batch. Each token's logprob is that of the weights that sampled
it; a reply's ``weight_version`` is the one that sampled its first token (the
oldest, so the trainer's lag is never understated).

The model is a Hugging Face causal LM (``HFPolicy``): prompts are rendered by
its tokenizer's chat template with the request's ``tools``, and replies are
split into content and ``tool_calls`` by the hermes parser
(``nemo_rl.models.chat.parse_tool_calls``), as vLLM's ``hermes`` parser would:
only when the request lists tools (``parse_reply``), else the text is content.

Replies carry four extensions Gym's model server passes through for training:
``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs`` and
``weight_version``. The reply's ``model`` is always the served model's name,
whatever the request named.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import ray
import torch
from aiohttp import web
from pydantic import ValidationError

from gym_patches.checkpoint.cuts import CALL_ID_HEADER, CALL_INDEX_HEADER, RESEND_HEADER, PrefixContinuation, prompt_digest
from nemo_rl.models.chat import parse_reply, render_prompt
from nemo_rl.models.generation.call_seeds import CallDraws, parse_call_index, prompt_key, request_seed
from nemo_rl.models.generation.continuation import Continuation, count_resend, init_stats, stats_now
from nemo_rl.models.generation.cut_pins import CutPins, LiveCall
from nemo_rl.models.generation.http_front import serve_openai_routes
from nemo_rl.models.generation.worker_log import redirect_output
from nemo_rl.models.generation.protocol import (
    ChatCompletionRequest,
    check_call_id,
    check_tools,
    error_body,
)
from nemo_rl.models.policy import HFPolicy, SampleOutput, load_tokenizer, resolve_device, resolve_dtype
from nemo_rl.models.policy_config import PolicyConfig


@dataclass
class _Job:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    future: asyncio.Future = field(repr=False)
    top_k: int = 0
    ignore_eos: bool = False
    # Filled in place by the decode thread; a generation cut reads it from the event loop (through ``live``).
    out: SampleOutput = field(default_factory=lambda: SampleOutput([], [], "length"), repr=False)
    live: LiveCall | None = field(default=None, repr=False)  # its version is set as the batch starts
    draws: CallDraws | None = None  # deterministic sampling: the call's seed and its first token's index


@dataclass
class _PendingRefit:
    """Weights waiting for the decode thread, and every refit call they answer (racing refits share one slot:
    the highest version's weights are loaded and every caller gets that version)."""

    state: dict[str, torch.Tensor]
    version: int
    waiters: list[Callable[[int | None, BaseException | None], None]] = field(default_factory=list)


def _settle(fut: asyncio.Future, version: int | None, err: BaseException | None) -> None:
    if fut.done():  # the caller went away
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(version)


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def _load_weights(weights: Any) -> dict[str, torch.Tensor]:
    if isinstance(weights, (bytes, bytearray, memoryview)):
        weights = torch.load(io.BytesIO(bytes(weights)), map_location="cpu", weights_only=True)
    if not isinstance(weights, dict):
        raise TypeError(f"refit expects a state dict or its torch.save bytes, got {type(weights).__name__}")
    return weights


def model_files(directory: str | Path) -> dict[str, bytes]:
    """A model directory's small files (config, tokenizer, chat template), no weights: what the worker needs
    besides the weights, shippable to an actor on another node."""
    out = {}
    for f in sorted(Path(directory).iterdir()):
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt", ".pth")) and f.stat().st_size < 64 << 20:
            out[f.name] = f.read_bytes()
    return out


def _materialize(files: dict[str, bytes]) -> str:
    d = tempfile.mkdtemp(prefix="nemo_rl_gen_model_")
    for name, data in files.items():
        if "/" in name or name.startswith("."):
            raise ValueError(f"model file name {name!r} is not a plain file name")
        (Path(d) / name).write_bytes(data)
    return d


class GenerationServer:
    """Plain-Python implementation; ``GenerationWorker`` is its Ray actor form.

    ``model`` is a local model directory or ``model_files(dir)``; ``weights``
    (a state dict or its ``torch.save`` bytes) replace the directory's weights
    (required with ``model_files``, which carry none).
    """

    def __init__(
        self,
        policy_cfg: PolicyConfig | dict,
        model: str | dict[str, bytes],
        weights: Any = None,
        weight_version: int = 0,
        seed: int = 0,
        model_name: str | None = None,
        log_path: str | None = None,
        deterministic: bool = False,
    ):
        """``deterministic`` (``grpo.deterministic``): each call is sampled by draws from its own seed
        (``call_seeds``: ``seed``, its rollout, its index), decoded alone (batched floats differ from a
        row decoded alone), and new weights load only between calls."""
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        if log_path is not None:  # the run's log dir names it when this worker is lost
            redirect_output(log_path)
        hf_logging.disable_progress_bar()
        torch.set_num_threads(1)
        self.cfg = policy_cfg if isinstance(policy_cfg, PolicyConfig) else PolicyConfig.model_validate(policy_cfg)
        if self.cfg.generation.backend != "torch":
            raise ValueError(
                f"policy.generation.backend={self.cfg.generation.backend!r}: this worker is the torch backend"
            )
        self.model_name = model_name or self.cfg.model_name
        if isinstance(model, dict):
            if weights is None:
                raise ValueError("GenerationServer: model files carry no weights; pass weights")
            source = self._tmp_dir = _materialize(model)
        else:
            self._tmp_dir = None
            source = str(model)
        dev, dtype = resolve_device(self.cfg.device), resolve_dtype(self.cfg.dtype)
        if weights is not None:
            hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=dtype)
            if (Path(source) / "generation_config.json").is_file():
                from transformers import GenerationConfig

                hf_model.generation_config = GenerationConfig.from_pretrained(source)
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        self.policy = HFPolicy(hf_model.to(dev).eval(), load_tokenizer(source), self.cfg.max_seq_len)
        for p in self.policy.parameters():
            p.requires_grad_(False)
        if weights is not None:
            self.policy.load_state(_load_weights(weights))
        self.tokenizer = self.policy.tokenizer
        self._version = int(weight_version)
        self._gen = torch.Generator(device=self.policy.device).manual_seed(seed)
        self._run_seed = int(seed)
        self.deterministic = bool(deterministic)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generation")
        # The refit slot: the event loop fills it, the decode thread empties it (at a step boundary while a
        # batch decodes, else at once); the lock makes "is a batch decoding?" and "fill the slot" one step.
        self._slot_lock = threading.Lock()
        self._pending: _PendingRefit | None = None
        self._decoding = False
        self._accept: asyncio.Lock | None = None
        self._newest: tuple[int, asyncio.Future] | None = None  # the highest version a refit call waits for
        self._queue: asyncio.Queue[_Job] | None = None
        self._batcher: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self.base_url: str | None = None
        self.created = int(time.time())
        # refits: weight loads applied; refits_in_flight: those applied while a batch decoded;
        # decoding_rows: rows of the batch decoding now (0 between batches); decode_steps: step
        # boundaries passed (the points where an in-flight refit can land), all batches together
        self.stats = {"requests": 0, "batches": 0, "generated_tokens": 0, "refits": 0, "refits_in_flight": 0,
                      "decoding_rows": 0, "decode_steps": 0}
        init_stats(self.stats)  # continued, continued_tokens, discarded
        self.cuts = CutPins(self.stats)  # calls named by X-NG-Call-Id, and their generation-cut pins

    # ----- lifecycle -----------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0, reuse_port: bool = False) -> str:
        """Start serving; returns the base URL ending in ``/v1``."""
        if self._runner is not None:
            return self.base_url
        self._queue = asyncio.Queue()
        self._batcher = asyncio.get_running_loop().create_task(self._batch_loop())
        self._runner, self.base_url = await serve_openai_routes(
            host, port, chat=self._handle_chat, models=self._handle_models, health=self._handle_health,
            cuts=self.cuts.routes, reuse_port=reuse_port)
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        batcher, self._batcher = self._batcher, None
        if batcher is not None:  # ended before the executor shuts down; a cancellation of stop() propagates
            batcher.cancel()
            await asyncio.wait({batcher})
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)

    # ----- weights -------------------------------------------------------
    def _check_fits(self, state: dict[str, torch.Tensor]) -> None:
        """Refuse weights that would load only in part, before any reach a batch in flight."""
        own = self.policy.model.state_dict()
        tied = set(getattr(self.policy.model, "_tied_weights_keys", None) or [])
        for k, v in state.items():
            if k not in own:
                raise ValueError(f"refit: weights do not fit this model: unexpected key {k!r}")
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(own[k].shape):
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"refit: weights do not fit this model: {k!r} is {got}, "
                                 f"the model's is {tuple(own[k].shape)}")
        missing = [k for k in own if k not in state and k not in tied and not k.endswith("lm_head.weight")]
        if missing:
            raise ValueError(f"refit: weights do not fit this model: missing {missing[:5]}")

    def _apply_pending(self, in_flight: bool) -> None:
        """On the decode thread: load the slot's weights, if any, and answer its callers."""
        if self._pending is None:  # the per-step fast path: no lock
            return
        with self._slot_lock:
            p, self._pending = self._pending, None
        if p is None:
            return
        err: BaseException | None = None
        try:
            self.policy.load_state(p.state)
        except Exception as e:  # noqa: BLE001 - the callers get it; the batch decodes on
            err = e
        else:
            self._version = p.version
            self.stats["refits"] += 1
            self.stats["refits_in_flight"] += int(in_flight)
        for answer in p.waiters:
            try:
                answer(p.version, err)
            except RuntimeError:  # the caller's loop is closed (server stopping): nobody to answer
                pass

    async def refit(self, weights: Any, weight_version: int) -> int:
        """Load new weights; returns the version in force once they are loaded.

        With no batch decoding they load at once (on the decode thread); while one decodes they load at its
        next step boundary, and its rows carry on with the new weights and their KV cache. Refits that race
        (one arrives before an earlier one has returned) never step back: a lower version than one still
        waiting is superseded (its weights are never loaded; it returns, or raises, what the higher one
        does), and racing versions that are not lower replace the waiting weights, so the highest loads once
        and every caller gets it. A refit that arrives after the others returned loads whatever version it
        names, lower ones included (a trainer restored from an older checkpoint rolls its workers back).
        """
        if not isinstance(weight_version, int) or weight_version < 0:
            raise ValueError(f"weight_version must be a non-negative int, got {weight_version!r}")
        loop = asyncio.get_running_loop()
        if self._accept is None:
            self._accept = asyncio.Lock()
        async with self._accept:  # FIFO: racing refits are decided in arrival order
            if isinstance(weights, dict):
                state = weights
            else:  # deserialize off the decode thread, which may be mid-batch
                state = await loop.run_in_executor(None, _load_weights, weights)
            self._check_fits(state)
            newest = self._newest
            if newest is not None and not newest[1].done() and weight_version < newest[0]:
                waited = asyncio.shield(newest[1])  # superseded: never loaded
            else:
                waited = fut = loop.create_future()
                answer = lambda v, e: loop.call_soon_threadsafe(_settle, fut, v, e)  # noqa: E731
                with self._slot_lock:
                    p = self._pending
                    if p is None:
                        self._pending = _PendingRefit(state, weight_version, [answer])
                    else:
                        if weight_version >= p.version:
                            p.state, p.version = state, weight_version
                        p.waiters.append(answer)
                    idle = not self._decoding
                self._newest = (weight_version, fut)
                if idle:  # else the decode thread loads it at its next step boundary or as the batch ends
                    loop.run_in_executor(self._executor, self._apply_pending, False)
        return await waited

    async def weight_version(self) -> int:
        return self._version

    async def logprobs(self, prompt_ids: list[int], gen_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Score ``gen_ids`` after ``prompt_ids`` with the current weights."""
        loop = asyncio.get_running_loop()
        fn = lambda: self.policy.token_logprobs(prompt_ids, gen_ids, temperature).tolist()  # noqa: E731
        return await loop.run_in_executor(self._executor, fn)

    async def process(self) -> dict:
        """This worker's pid and Ray node: a restart waits until its process tree is gone."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    async def get_stats(self) -> dict:
        return stats_now(self.stats)

    # ----- generation ----------------------------------------------------
    async def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_k: int = 0,
                       ignore_eos: bool = False, live: LiveCall | None = None, draws: CallDraws | None = None) -> dict:
        """Queue one prompt; resolves to ``{token_ids, logprobs, finish_reason, weight_version}``.
        ``live`` (a call a cut may name) is given the job, so a cut reads its tokens as they come;
        ``draws`` sample it deterministically."""
        if self._queue is None:
            raise RuntimeError("call start() before generate()")
        if len(prompt_ids) >= self.policy.max_seq_len:
            raise _BadRequest(
                f"messages: the prompt is {len(prompt_ids)} tokens; this model's maximum context length is "
                f"{self.policy.max_seq_len} tokens",
                "messages",
                "context_length_exceeded",
            )
        fut = asyncio.get_running_loop().create_future()
        job = _Job(list(prompt_ids), int(max_new_tokens), float(temperature), fut, int(top_k), bool(ignore_eos),
                   live=live, draws=draws)
        if live is not None:  # a cut reads the job's output as the decode thread appends to it
            live.ids, live.lps = job.out.token_ids, job.out.logprobs
        await self._queue.put(job)
        return await fut

    def _between_steps(self) -> None:
        self.stats["decode_steps"] += 1
        if not self.deterministic:  # deterministic: a call's tokens all come from the weights it started with
            self._apply_pending(True)

    def _decode_batch(self, jobs: list[_Job]) -> tuple[list, int]:
        """Decode one batch; returns its outputs and the version that sampled its first tokens."""
        with self._slot_lock:
            self._decoding = True
        self.stats["decoding_rows"] = len(jobs)
        try:
            self._apply_pending(False)  # arrived before this batch: load it first, between batches
            version = self._version
            for j in jobs:
                if j.live is not None:
                    j.live.version = version
            outs = self.policy.sample_batch(
                [j.prompt_ids for j in jobs],
                [j.max_new_tokens for j in jobs],
                [j.temperature for j in jobs],
                generator=self._gen,
                top_k=[j.top_k for j in jobs],
                between_steps=self._between_steps,
                outputs=[j.out for j in jobs],
                ignore_eos=[j.ignore_eos for j in jobs],
                draws=[j.draws for j in jobs] if self.deterministic else None,
            )
        finally:
            with self._slot_lock:
                self._decoding = False
            self.stats["decoding_rows"] = 0
            self._apply_pending(False)  # arrived after the last step boundary: no token of this batch used it
        return outs, version

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        # Deterministic: one call at a time (a row's floats in a batch differ from the same row alone on CPU).
        window = 0.0 if self.deterministic else self.cfg.generation.batch_window_ms / 1000.0
        limit = 1 if self.deterministic else self.cfg.generation.max_batch_size
        while True:
            jobs = [await self._queue.get()]
            if window > 0:
                await asyncio.sleep(window)
            while not self._queue.empty() and len(jobs) < limit:
                jobs.append(self._queue.get_nowait())
            jobs = [j for j in jobs if not j.future.done()]  # client went away
            if not jobs:
                continue
            try:
                outs, version = await loop.run_in_executor(self._executor, self._decode_batch, jobs)
            except Exception as e:  # surface to every waiting request, keep serving
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(e)
                continue
            self.stats["batches"] += 1
            for j, o in zip(jobs, outs):
                self.stats["generated_tokens"] += len(o.token_ids)
                if not j.future.done():
                    j.future.set_result(
                        {"token_ids": o.token_ids, "logprobs": o.logprobs, "top": o.top,
                         "finish_reason": o.finish_reason, "weight_version": version}
                    )

    # ----- HTTP ----------------------------------------------------------
    async def _handle_models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                         "owned_by": "nemo_rl", "max_model_len": self.policy.max_seq_len}]}
        )

    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "weight_version": self._version})

    @staticmethod
    def _call_headers(request: web.Request) -> tuple[str | None, int | None]:
        """The call's ``X-NG-Call-Id`` and ``X-NG-Call-Index`` (either may be absent); a bad one is refused."""
        call_id = request.headers.get(CALL_ID_HEADER)
        bad_id = check_call_id(call_id)
        if bad_id is not None:
            raise _BadRequest(bad_id, CALL_ID_HEADER)
        try:
            return call_id, parse_call_index(request.headers.get(CALL_INDEX_HEADER))
        except ValueError as e:
            raise _BadRequest(str(e), CALL_INDEX_HEADER) from None

    async def _handle_chat(self, request: web.Request) -> web.Response:
        try:
            call_id, call_index = self._call_headers(request)
            try:
                body = await request.json()
            except Exception:
                raise _BadRequest("request body is not valid JSON", "body") from None
            if not isinstance(body, dict):
                raise _BadRequest("request body must be a JSON object", "body")
            try:
                req = ChatCompletionRequest.model_validate(body)
            except ValidationError as e:
                err = e.errors()[0]
                loc = ".".join(str(x) for x in err["loc"]) or "body"
                raise _BadRequest(f"{loc}: {err['msg']}", loc) from None
            if req.top_logprobs and not req.logprobs:
                raise _BadRequest("top_logprobs: needs logprobs=true", "top_logprobs")
            bad_tool = check_tools(req.tools)
            if bad_tool is not None:
                raise _BadRequest(bad_tool, bad_tool.split(":")[0])
            try:
                prompt_ids = render_prompt(self.tokenizer, req.messages, req.tools)
            except ValueError as e:
                msg = str(e)
                param = msg.split(":")[0] if msg.startswith("messages[") else "messages"
                raise _BadRequest(msg, param) from None
            gen_cfg = self.cfg.generation
            temperature = gen_cfg.temperature if req.temperature is None else req.temperature
            max_new = req.max_completion_tokens or req.max_tokens or gen_cfg.max_new_tokens
            self.stats["requests"] += 1
            if gen_cfg.ignore_eos:
                req.ignore_eos = True
            live = None if call_id is None else LiveCall(prompt_digest(prompt_ids))
            seed = request_seed(self._run_seed, call_id, call_index, prompt_key(prompt_ids)) \
                if self.deterministic else None
            with self.cuts.tracking(call_id, live):
                out, continuation = await self._generate_call(req, prompt_ids, max_new, temperature, live,
                                                              call_id, request.headers.get(RESEND_HEADER), seed)
        except _BadRequest as e:
            return web.json_response(error_body(str(e), e.param, e.code), status=400)
        body = self._completion_body(req, prompt_ids, out)
        if continuation is not None:
            body["prefix_continuation"] = continuation.model_dump()
        return web.json_response(body)

    async def _generate_call(self, req: ChatCompletionRequest, prompt_ids: list[int], max_new: int,
                             temperature: float, live: LiveCall | None, call_id: str | None = None,
                             resend: str | None = None, seed: int | None = None,
                             ) -> tuple[dict, PrefixContinuation | None]:
        """Decode one call: from its start, or after the saved prefix ``ng_prefix`` when ``Continuation``
        keeps it (else it is discarded and the call starts over). ``seed``: deterministic sampling, the
        tail's draws continuing after the prefix's tokens."""
        plan = Continuation.of(req.ng_prefix)
        if plan is not None:
            plan.check_prompt(prompt_ids)
        count_resend(self.stats, resend, call_id, plan)
        if plan is None or not plan.kept:
            out = await self.generate(prompt_ids, max_new, temperature, req.top_logprobs or 0, req.ignore_eos, live,
                                      None if seed is None else CallDraws(seed))
            return out, None if plan is None else plan.reply(self.stats)
        ids, lps = plan.ids, plan.lps
        plan.follow(live)
        budget = plan.budget(max_new, self.policy.max_seq_len, len(prompt_ids))
        finish = plan.finish_reason(self.policy.stop_ids, req.ignore_eos, budget)
        if finish is not None:  # the cut already holds the whole reply: nothing to decode
            tail = {"token_ids": [], "logprobs": [], "top": [], "finish_reason": finish}
        else:
            tail = await self.generate(prompt_ids + ids, budget, temperature, req.top_logprobs or 0,
                                       req.ignore_eos, live, None if seed is None else CallDraws(seed, len(ids)))
        continuation = plan.reply(self.stats)
        tops = tail.get("top") or [[] for _ in tail["token_ids"]]
        out = {"token_ids": ids + tail["token_ids"], "logprobs": lps + tail["logprobs"],
               "top": [[] for _ in ids] + list(tops), "finish_reason": tail["finish_reason"],
               "weight_version": plan.weight_version(tail.get("weight_version"))}
        return out, continuation

    def _logprob_entry(self, token_id: int, logprob: float) -> dict:
        text = self.policy.token_str(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _completion_body(self, req: ChatCompletionRequest, prompt_ids: list[int], out: dict) -> dict:
        gen = out["token_ids"]
        content, tool_calls = parse_reply(self.policy.decode_completion(gen), req.tools)
        finish = out["finish_reason"]
        if finish == "stop" and tool_calls:
            finish = "tool_calls"
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        tops = out.get("top") or [[] for _ in gen]
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": {
                        "content": [
                            {**self._logprob_entry(t, lp),
                             "top_logprobs": [self._logprob_entry(ti, tv) for ti, tv in top]}
                            for t, lp, top in zip(gen, out["logprobs"], tops)
                        ]
                    },
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(gen),
                "total_tokens": len(prompt_ids) + len(gen),
            },
            "prompt_token_ids": prompt_ids,
            "generation_token_ids": gen,
            "generation_log_probs": out["logprobs"],
            "weight_version": out["weight_version"],
        }


# The Ray actor. Size it with .options(num_cpus=..., num_gpus=...) at creation.
GenerationWorker = ray.remote(GenerationServer)
