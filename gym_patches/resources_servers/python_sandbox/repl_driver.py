"""REPL driver that runs *inside* a sandbox subprocess (stdlib only).

Protocol: one JSON object per line on the original stdin,
``{"op": "exec"|"eval", "code": str}``; one JSON reply per line on the original
stdout, ``{"ok": bool, "out": str, "error": str|None, "value": str|None,
"interrupted": bool}``. The protocol pipes are moved to private descriptors at
start-up, so user code that reads fd 0 or writes fd 1 cannot corrupt them.
SIGINT interrupts running user code only (the parent's timeout); between
requests it is ignored, so a late interrupt never kills the session.
"""

import ast
import builtins
import io
import json
import os
import signal
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout

MAX_OUTPUT_CHARS = 8000
_state = {"running": False}


class _CappedIO(io.StringIO):
    """Captures user output, keeping at most MAX_OUTPUT_CHARS characters."""

    def __init__(self):
        super().__init__()
        self.dropped = 0

    def write(self, s):
        room = MAX_OUTPUT_CHARS - self.tell()
        if room <= 0:
            self.dropped += len(s)
            return len(s)
        if len(s) > room:
            self.dropped += len(s) - room
        super().write(s[:room])
        return len(s)

    def text(self):
        out = self.getvalue()
        if self.dropped:
            out += f"\n...[{self.dropped} characters cut]\n"
        return out


def _on_sigint(signum, frame):
    if _state["running"]:
        raise KeyboardInterrupt


def _error_text(exc):
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _exec(code, ns):
    """Run statements; a trailing expression's repr is printed, as in a REPL."""
    tree = ast.parse(code, "<sandbox>", "exec")
    tail = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        tail = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<sandbox>", "exec"), ns)
    if tail is not None:
        value = eval(compile(tail, "<sandbox>", "eval"), ns)
        if value is not None:
            print(repr(value))
    return None


def _eval(code, ns):
    return repr(eval(compile(code, "<sandbox>", "eval"), ns))


def handle(request, ns):
    op, code = request.get("op"), request.get("code")
    if op not in ("exec", "eval") or not isinstance(code, str):
        return {"ok": False, "out": "", "error": "ProtocolError: bad request",
                "value": None, "interrupted": False}
    buf = _CappedIO()
    reply = {"ok": True, "out": "", "error": None, "value": None, "interrupted": False}
    try:
        with redirect_stdout(buf), redirect_stderr(buf):
            try:
                _state["running"] = True
                reply["value"] = (_exec if op == "exec" else _eval)(code, ns)
            finally:
                _state["running"] = False
    except KeyboardInterrupt:
        reply.update(ok=False, interrupted=True, error="KeyboardInterrupt")
    except BaseException as exc:  # user code may raise anything, SystemExit included
        reply.update(ok=False, error=_error_text(exc))
    reply["out"] = buf.text()
    return reply


def main():
    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    sys.stdin = io.StringIO("")
    signal.signal(signal.SIGINT, _on_sigint)
    ns = {"__name__": "__main__", "__builtins__": builtins}
    proto_out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    proto_out.flush()
    for line in proto_in:
        try:
            request = json.loads(line)
        except ValueError:
            request = {}
        reply = handle(request if isinstance(request, dict) else {}, ns)
        proto_out.write(json.dumps(reply) + "\n")
        proto_out.flush()


if __name__ == "__main__":
    main()
