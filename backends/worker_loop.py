"""The loop of an offline-mode engine worker (backends/vllm_worker.py, backends/sglang_worker.py).
It runs in the engine's own environment, so it uses the standard library only.

Protocol: one JSON request per line on stdin, {"op": ..., ...}; one answer per request, on the
file descriptor SPECSWEEP_ANSWER_FD (the engine logs to stdout and stderr, which the adapter
saves): {"ok": true, ...} or {"ok": false, "error", "kind"}, where kind "init" means the engine
refused its configuration (the worker then exits), "run" a failed request, "protocol" an
unknown op. "close" answers, then ends the loop.
"""
from __future__ import annotations

import json
import os
import sys
import traceback


def serve(handlers: dict) -> int:
    """Answer requests with handlers[op](request) -> dict of answer fields."""
    answer = os.fdopen(int(os.environ.get("SPECSWEEP_ANSWER_FD", "3")), "w", buffering=1)

    def reply(**kw):
        answer.write(json.dumps(kw) + "\n")

    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        if op not in handlers:
            reply(ok=False, error=f"unknown op {op!r}; this worker knows {', '.join(handlers)}", kind="protocol")
            continue
        try:
            reply(ok=True, **handlers[op](req))
        except Exception as e:  # the adapter turns this into a clear error; the traceback goes to the log
            traceback.print_exc()
            reply(ok=False, error=f"{type(e).__name__}: {e}", kind="init" if op == "init" else "run")
            if op == "init":
                break
        if op == "close":
            break
    return 0
