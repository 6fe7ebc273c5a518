"""The loop of an offline-mode engine worker (backends/vllm_worker.py, sglang_worker.py and
llamacpp_worker.py). It runs in the engine's own environment, so it uses the standard library
only.

Protocol: one JSON request per line on stdin, {"op": ..., ...}; one answer per request, on the
file descriptor SPECSWEEP_ANSWER_FD (the engine logs to stdout and stderr, which the adapter
saves): {"ok": true, ...} or {"ok": false, "error", "kind"}, where kind "init" means the engine
refused its configuration (the worker then exits), "run" a failed request, "protocol" an
unknown op. "close" answers, then ends the loop.

The worker leads a process group of its own (backends/processes.py starts it in a session of its
own) that holds every process its engine starts. SIGTERM (the adapter stopping it, or the kernel
when the sweep process dies: PR_SET_PDEATHSIG) ends that whole group, and so does an end of the
loop other than a close (stdin closed by a dead sweep, a refused init): vLLM's EngineCore and
workers, or SGLang's schedulers, never outlive the worker.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback


def _group_members() -> list[int]:
    """The other live processes of this process's group (Linux /proc; elsewhere: none known)."""
    me, group, out = os.getpid(), os.getpgid(0), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            out.append(int(name))
    return out


def end_group(grace_s: float = 5.0) -> None:
    """Stop every other process of this worker's group: SIGTERM, then SIGKILL to the group (this
    process with it) if any is left after grace_s. Nothing when this process does not lead a
    group of its own (run by hand from a shell: the shell's group is never signalled)."""
    if os.getpgid(0) != os.getpid() or not _group_members():
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM reaches this process too
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap this process's own children as they exit
                pass
        except ChildProcessError:
            pass
        if not _group_members():
            return
        time.sleep(0.1)
    os.killpg(0, signal.SIGKILL)


def _terminated(signum, frame):
    end_group()
    os._exit(128 + signum)


def serve(handlers: dict) -> int:
    """Answer requests with handlers[op](request) -> dict of answer fields."""
    answer = os.fdopen(int(os.environ.get("SPECSWEEP_ANSWER_FD", "3")), "w", buffering=1)

    def reply(**kw):
        answer.write(json.dumps(kw) + "\n")

    signal.signal(signal.SIGTERM, _terminated)
    closed = False
    try:
        closed = _loop(handlers, reply)
    finally:
        if not closed:  # a dead sweep, a refused init: nothing of the engine is left behind
            end_group()
    return 0  # after a close the engine shuts down as it exits (the adapter then ends what is left)


def _loop(handlers: dict, reply) -> bool:
    """True when a close ended it."""
    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        if op not in handlers:
            reply(ok=False, error=f"unknown op {op!r}; this worker knows {', '.join(handlers)}", kind="protocol")
            continue
        try:
            reply(ok=True, **handlers[op](req))
            if signal.getsignal(signal.SIGTERM) is not _terminated:  # an engine's init took SIGTERM over
                signal.signal(signal.SIGTERM, _terminated)
        except Exception as e:  # the adapter turns this into a clear error; the traceback goes to the log
            traceback.print_exc()
            reply(ok=False, error=f"{type(e).__name__}: {e}", kind="init" if op == "init" else "run")
            if op == "init":
                break
        if op == "close":
            return True
    return False
