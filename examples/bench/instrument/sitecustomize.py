"""Benchmark instrumentation for RL runs started by the recovery benchmark.

Python imports ``sitecustomize`` at startup from the first ``sys.path`` entry
that has one; the benchmark puts this directory on ``PYTHONPATH`` of the
``run_grpo.py`` processes it starts (Ray workers and Gym servers inherit it).
It only observes (but for ``BENCH_SCRIPTED_HOLD``, a gate); with none of the variables below set it does nothing.

- ``BENCH_AUDIT_DIR``: in the Gym policy model server process
  (``NEMO_GYM_CONFIG_PATH`` = ``BENCH_AUDIT_MODEL``, default ``policy_model``),
  append one JSON line per finished generation to
  ``<dir>/model-<pid>.jsonl``: capture key, turn index (assistant messages
  already in the request), generated tokens, HTTP status, wall time at its start
  (``t0``) and end (``t``). Lines are flushed as written, so a SIGKILL loses none
  that were written. A call a replay answers from its record never reaches the
  backend, so it has no line.
- ``BENCH_TIMING_FILE``: append ``{event, start, end, pid, ok}`` lines for
  ``ray.init``, ``_spinup_gym`` (driver) and ``GymDeployment.start`` (the Gym
  actor), plus one ``process_start`` line per process running ``run_grpo.py``.
- ``BENCH_SNAPSHOT_TIMING``: in the controller (the ``run_grpo.py`` driver),
  append one line per rollout snapshot attempt (``RolloutSnapshotter.attempt``:
  start, end, checkpoint id, committed, pause_s, persist_s), per Gym checkpoint
  call across the replicas (``GymCheckpointCoordinator._collect``: operation,
  start, end) and per publish (``commit_snapshot`` as the snapshot module calls
  it). The product's code runs unchanged; these only time it.
- ``BENCH_TOOL_LOG``: in every resources server process, append one line per
  tool call when it returns (server, tool, end time, HTTP status).
- ``BENCH_LOOP_LAG``: in every Gym server process, append to ``<dir>/loop-<server>.jsonl`` one line
  per turn of its asyncio event loop whose callbacks ran at least ``BENCH_LOOP_LAG_MS`` (default 100;
  the wait in ``select()`` before them is not counted): start, busy time, callbacks run, and the
  callbacks that took the most of it, by name (a task by its coroutine), and the cyclic garbage
  collector's time in the turn (``gc_s``; ``gc``: generation, seconds, objects collected). What a checkpoint request arriving then waits for before its handler runs.
- ``BENCH_CONTROL_LOG``: in every Gym server process, append to ``<dir>/control-<server>.jsonl`` one
  line per prepare request its control plane served: checkpoint id, handler start and end, the wait
  for readiness inside it (``wait_start``/``wait_end``) and the phase it answered.
- ``BENCH_WEIGHTS_LOG``: in the generation worker (torch ``GenerationServer`` or vLLM
  ``VllmGenerationServer``), append one line per shipment of weights it receives (``torch.save`` bytes,
  as the run's generation backend sends them): at its construction and at each refit (event, bytes,
  time, pid). Counted where they arrive, so it counts the same on any commit of the product.

- ``BENCH_SCRIPTED_HOLD``: the one variable that changes what a run does (a gate, not an
  observation): ``<dir>/holds.json`` lists ``[user text, turn]`` pairs; in the driver, right after the
  scripted backend got its plans (before Gym starts, so before any rollout), each pair is held there,
  and ``<dir>/backend_url`` is written. A held rollout stops with exactly ``turn`` finished model calls
  and stays so across every snapshot until the caller releases it (``POST /scripted/release``) or the
  run ends; the replay benchmark and ``tests/functional/test_replay_recovery.py`` wait for that event
  instead of for a run slow enough to contain it.

Patches are applied right after the target module is first imported (a
``sys.meta_path`` finder), so processes that never import it pay nothing.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

_STARTED = time.time()


def _safe(name, hook):
    """A hook that never breaks the process it instruments."""
    def run(module):
        try:
            hook(module)
        except Exception as exc:
            print(f"bench instrumentation: hook for {name} failed: {exc!r}", file=sys.stderr)
    return run


def _append(path, record):
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


# -- model audit ---------------------------------------------------------------------------
def _audit_model(audit_dir):
    def hook(module):
        os.makedirs(audit_dir, exist_ok=True)
        path = os.path.join(audit_dir, f"model-{os.getpid()}.jsonl")
        cls = module.VLLMModelServer
        original = cls._generate

        @functools.wraps(original)
        async def _generate(self, ticket, chat_body, *rest, **kw):
            started = time.time()
            resp = await original(self, ticket, chat_body, *rest, **kw)
            try:
                messages = chat_body.get("messages") or []
                turn = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
                tokens = 0
                if resp.status == 200 and resp.body:
                    body = json.loads(resp.body)
                    for item in body.get("output") or []:
                        ids = item.get("generation_token_ids") if isinstance(item, dict) else None
                        if isinstance(ids, list):
                            tokens += len(ids)
                _append(path, {"key": ticket.capture_key, "turn": turn, "tokens": tokens,
                               "status": resp.status, "t0": started, "t": time.time()})
            except Exception as exc:
                print(f"bench instrumentation: audit failed: {exc!r}", file=sys.stderr)
            return resp

        cls._generate = _generate

    return hook


# -- scripted holds (driver) ------------------------------------------------------------------
def _scripted_hold(gate):
    def hook(module):
        holds = json.loads(open(os.path.join(gate, "holds.json")).read())
        backend = module.ScriptedBackend
        plans_from_rows = backend.plans_from_rows

        @functools.wraps(plans_from_rows)
        def held_plans_from_rows(self, *args, **kwargs):
            plans = plans_from_rows(self, *args, **kwargs)
            for user, turn in holds:
                self.hold(user, int(turn))
            tmp = os.path.join(gate, "backend_url.tmp")
            with open(tmp, "w") as f:
                f.write(self.url)
            os.replace(tmp, os.path.join(gate, "backend_url"))
            print(f"bench instrumentation: {len(holds)} scripted turn(s) held at {self.url}", file=sys.stderr,
                  flush=True)
            return plans

        backend.plans_from_rows = held_plans_from_rows

    return hook


# -- snapshot timing (controller) -----------------------------------------------------------
def _snapshot_hooks(path):
    def coordinator_hook(module):
        cls = module.GymCheckpointCoordinator

        def timed(original, operation_of):
            @functools.wraps(original)
            async def wrapper(self, *args, **kwargs):
                start, ok = time.time(), False
                try:
                    result = await original(self, *args, **kwargs)
                    ok = True
                    return result
                finally:
                    _append(path, {"event": f"gym:{operation_of(args)}", "start": start, "end": time.time(),
                                   "ok": ok})
            return wrapper

        # Every fan-out over the replicas (resume, commit, persist, renew, forget, ...) and the prepare,
        # which watches its replicas itself.
        cls._gather_replicas = timed(cls._gather_replicas, lambda args: args[0])
        cls._prepare_replicas = timed(cls._prepare_replicas, lambda args: "prepare")

    def snapshot_hook(module):
        cls = module.RolloutSnapshotter
        original = cls.attempt

        @functools.wraps(original)
        async def attempt(self, *args, **kwargs):
            start = time.time()
            outcome = None
            try:
                outcome = await original(self, *args, **kwargs)
                return outcome
            finally:
                rec = {"event": "attempt", "start": start, "end": time.time()}
                if outcome is not None:
                    for name in ("checkpoint_id", "committed", "reason", "saved", "unsaved", "not_admitted",
                                 "pause_s", "persist_s", "path"):
                        if hasattr(outcome, name):
                            rec[name] = getattr(outcome, name)
                _append(path, rec)

        cls.attempt = attempt

    def store_hook(module):
        module.commit_snapshot = _timed(path, "publish", module.commit_snapshot)

    return {"nemo_rl.algorithms.single_controller_utils.gym_coordinator": coordinator_hook,
            "nemo_rl.algorithms.single_controller_utils.rollout_snapshot.snapshotter": snapshot_hook,
            "nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store": store_hook}


# -- tool calls (resources servers) -----------------------------------------------------------
def _tool_hook(path):
    def hook(module):
        cls = module.SimpleResourcesServer
        original = cls._tool

        @functools.wraps(original)
        async def _tool(self, request):
            status = 0
            try:
                resp = await original(self, request)
                status = getattr(resp, "status", 200)
                return resp
            finally:
                _append(path, {"server": getattr(self, "name", "?"), "tool": request.match_info.get("tool_name"),
                               "end": time.time(), "status": status})

        cls._tool = _tool

    return {"gym_patches.resources_servers.base": hook}


# -- checkpoint control requests (Gym servers) -------------------------------------------------
def _control_hook(path):
    def hook(module):
        cls = module.ParticipantControlPlane
        prepare, wait_ready = cls._prepare, cls._wait_ready

        @functools.wraps(wait_ready)
        async def _wait_ready(self, *args, **kwargs):
            start = time.time()
            try:
                return await wait_ready(self, *args, **kwargs)
            finally:
                self._bench_waited = (start, time.time())

        @functools.wraps(prepare)
        async def _prepare(self, req):
            start, phase = time.time(), "error"
            self._bench_waited = None
            try:
                reply = await prepare(self, req)
                phase = reply.get("phase", "?") if isinstance(reply, dict) else "?"
                return reply
            finally:
                waited = self._bench_waited
                steps = dict(getattr(type(self), "_bench_steps", {}))
                getattr(type(self), "_bench_steps", {}).clear()
                _append(path, {"server": self.instance, "cid": req.checkpoint_id, "start": start, "end": time.time(),
                               "wait_start": waited and waited[0], "wait_end": waited and waited[1], "phase": phase,
                               "steps_s": steps})

        def timed_step(name, fn):
            @functools.wraps(fn)
            async def step(*args, **kwargs):
                start = time.time()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    _steps[name] = _steps.get(name, 0.0) + time.time() - start
            return step

        _steps = {}  # one prepare at a time per server: its steps' seconds
        cls._close_admission = timed_step("close", cls._close_admission)
        module.take_capture = timed_step("capture", module.take_capture)
        module.NewestCapture.replace = timed_step("replace", module.NewestCapture.replace)

        cls._prepare, cls._wait_ready = _prepare, _wait_ready
        cls._bench_steps = _steps

    return {"gym_patches.checkpoint.control.plane": hook}


# -- event-loop turns (Gym servers) ------------------------------------------------------------
def _callback_name(handle):
    callback = getattr(handle, "_callback", None)
    owner = getattr(callback, "__self__", None)
    get_coro = getattr(owner, "get_coro", None)
    if get_coro is not None:  # a task's step: name its coroutine, where it resumes, and a request's path
        coro = get_coro()
        name = f"task:{getattr(coro, '__qualname__', type(coro).__name__)}"
        request = getattr(getattr(coro, "cr_frame", None), "f_locals", {}).get("request")
        if getattr(request, "path", None):
            name += f" {request.method} {request.path}"
        inner = coro
        while getattr(inner, "cr_await", None) is not None and hasattr(inner.cr_await, "cr_frame"):
            inner = inner.cr_await
        if inner is not coro:
            name += f" <- {getattr(inner, '__qualname__', type(inner).__name__)}"
        return name
    return getattr(callback, "__qualname__", None) or type(callback).__name__


def _loop_lag_hook(path, threshold_s):
    def hook(module):
        base = module.BaseEventLoop
        handle_run = module.events.Handle._run
        turn = {"on": False, "names": {}, "count": 0, "first": None, "gc_s": 0.0, "gc": [], "gc_t0": None}

        def _gc(phase, info):  # the cyclic collector's time in the turn, by generation
            if phase == "start":
                turn["gc_t0"] = time.perf_counter()
            elif turn["gc_t0"] is not None:
                spent = time.perf_counter() - turn["gc_t0"]
                turn["gc_t0"] = None
                if turn["on"]:
                    turn["gc_s"] += spent
                    turn["gc"].append([info.get("generation"), round(spent, 4), info.get("collected")])

        import gc

        gc.callbacks.append(_gc)

        def _run(self):
            if not turn["on"]:
                return handle_run(self)
            name = _callback_name(self)  # before it runs: where a task resumes
            t0 = time.perf_counter()
            if turn["first"] is None:
                turn["first"] = t0  # the wait in select() ended: the turn's work starts here
            try:
                return handle_run(self)
            finally:
                spent, count = turn["names"].get(name, (0.0, 0))
                turn["names"][name] = (spent + time.perf_counter() - t0, count + 1)
                turn["count"] += 1

        original = base._run_once

        def _run_once(self):
            turn["on"], turn["names"], turn["count"], turn["first"] = True, {}, 0, None
            turn["gc_s"], turn["gc"] = 0.0, []
            start, t0 = time.time(), time.perf_counter()
            try:
                return original(self)
            finally:
                turn["on"] = False
                end = time.perf_counter()
                # busy: from the first callback to the end of the turn (the time a request that became
                # ready meanwhile waits); the wait in select() before it is idle time, not counted
                busy = end - turn["first"] if turn["first"] is not None else 0.0
                if busy >= threshold_s:
                    top = sorted(turn["names"].items(), key=lambda kv: -kv[1][0])[:8]
                    _append(path, {"start": start, "busy_s": round(busy, 4),
                                   "select_s": round(turn["first"] - t0, 4), "callbacks": turn["count"],
                                   "in_callbacks_s": round(sum(v[0] for v in turn["names"].values()), 4),
                                   "gc_s": round(turn["gc_s"], 4), "gc": turn["gc"][:10],
                                   "top": [[n, round(s, 4), c] for n, (s, c) in top]})

        module.events.Handle._run = _run
        base._run_once = _run_once

    return {"asyncio.base_events": hook}


# -- weights shipped to generation -------------------------------------------------------------
def _shipped_bytes(weights):
    """Bytes of a shipment of weights: ``torch.save`` bytes, or a state dict's tensors."""
    if weights is None:
        return 0
    if isinstance(weights, memoryview):
        return weights.nbytes
    if isinstance(weights, (bytes, bytearray)):
        return len(weights)
    if isinstance(weights, dict):
        return sum(int(getattr(v, "nbytes", 0)) for v in weights.values())
    return 0


def _weights_hook(path, function_name):
    """Wrap the worker module's function that every shipment of weights passes through (the torch worker's
    ``_load_weights``, the vLLM worker's ``_write_safetensors``; its methods are wrapped by Ray at
    ``ray.remote``, so a patch of a method would not be seen). The caller names the event."""
    def hook(module):
        original = getattr(module, function_name)

        @functools.wraps(original)
        def counted(weights, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_name
            _append(path, {"event": "construct" if caller == "__init__" else "refit",
                           "bytes": _shipped_bytes(weights), "time": time.time(), "pid": os.getpid()})
            return original(weights, *args, **kwargs)

        setattr(module, function_name, counted)
    return hook


# -- setup timing --------------------------------------------------------------------------
def _timed(path, event, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start, ok = time.time(), False
        try:
            result = fn(*args, **kwargs)
            ok = True
            return result
        finally:
            _append(path, {"event": event, "start": start, "end": time.time(), "pid": os.getpid(), "ok": ok})
    return wrapper


def _timing_hooks(path):
    def ray_hook(module):
        module.init = _timed(path, "ray_init", module.init)

    def setup_hook(module):
        module._spinup_gym = _timed(path, "spinup_gym", module._spinup_gym)

    def launch_hook(module):
        cls = module.GymDeployment
        original = cls.start.__func__
        cls.start = classmethod(_timed(path, "gym_deployment_start", original))

    return {"ray": ray_hook, "nemo_rl.algorithms.single_controller_utils.setup": setup_hook,
            "gym_patches.launch": launch_hook}


def _install():
    hooks = {}
    audit_dir = os.environ.get("BENCH_AUDIT_DIR")
    if audit_dir and os.environ.get("NEMO_GYM_CONFIG_PATH") == os.environ.get("BENCH_AUDIT_MODEL", "policy_model"):
        hooks["gym_patches.responses_api_models.vllm_model.app"] = _audit_model(audit_dir)
    snapshot_timing = os.environ.get("BENCH_SNAPSHOT_TIMING")
    if snapshot_timing:
        hooks.update(_snapshot_hooks(snapshot_timing))
    tool_log = os.environ.get("BENCH_TOOL_LOG")
    if tool_log:
        hooks.update(_tool_hook(tool_log))
    loop_lag = os.environ.get("BENCH_LOOP_LAG")
    server = os.environ.get("NEMO_GYM_CONFIG_PATH")
    if loop_lag and server:
        os.makedirs(loop_lag, exist_ok=True)
        threshold_s = float(os.environ.get("BENCH_LOOP_LAG_MS", "100")) / 1e3
        hooks.update(_loop_lag_hook(os.path.join(loop_lag, f"loop-{server}.jsonl"), threshold_s))
    control_log = os.environ.get("BENCH_CONTROL_LOG")
    if control_log and server:
        os.makedirs(control_log, exist_ok=True)
        hooks.update(_control_hook(os.path.join(control_log, f"control-{server}.jsonl")))
    weights_log = os.environ.get("BENCH_WEIGHTS_LOG")
    if weights_log:
        hooks["nemo_rl.models.generation.worker"] = _weights_hook(weights_log, "_load_weights")
        hooks["nemo_rl.models.generation.vllm_worker"] = _weights_hook(weights_log, "_write_safetensors")
    gate = os.environ.get("BENCH_SCRIPTED_HOLD")
    if gate:
        hooks["gym_patches.fakes.scripted_backend"] = _scripted_hold(gate)
    timing = os.environ.get("BENCH_TIMING_FILE")
    if timing:
        hooks.update(_timing_hooks(timing))
        # the run's driver: ``python -m testkit.run_grpo`` (sys.argv is not set yet at startup)
        if any(a.endswith("run_grpo.py") or a.endswith("run_grpo") for a in sys.orig_argv[:3]):
            _append(timing, {"event": "process_start", "start": _STARTED, "end": _STARTED, "pid": os.getpid(),
                             "ok": True})
    if hooks:
        from testkit.after_import import AfterImport  # the repository is on PYTHONPATH (testkit.run_harness)

        AfterImport.install({name: _safe(name, hook) for name, hook in hooks.items()})


try:
    _install()
except Exception as _exc:  # never break interpreter startup
    print(f"bench instrumentation disabled: {_exc!r}", file=sys.stderr)
