"""The process that runs sglang.Engine for backends/sglang.py (offline mode), started with the
interpreter that has SGLang; imports nothing of specsweep. The protocol is backends/vllm_worker.py's:
JSON lines on stdin, one answer per request on the descriptor SPECSWEEP_ANSWER_FD.

Requests: {"op": "init", "llm": {...sglang.Engine keyword arguments...}}, {"op": "generate",
"prompts": [[ids]], "sampling": {...SGLang sampling params...}}, {"op": "close"}. The generate
answer has each request's output_ids and meta_info as SGLang returns them.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


def main() -> int:
    answer = os.fdopen(int(os.environ.get("SPECSWEEP_ANSWER_FD", "3")), "w", buffering=1)
    engine = None

    def reply(**kw):
        answer.write(json.dumps(kw) + "\n")

    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "init":
                t0 = time.perf_counter()
                import sglang

                engine = sglang.Engine(**req["llm"], enable_metrics=True)
                reply(ok=True, start_s=time.perf_counter() - t0, version=sglang.__version__)
            elif op == "generate":
                t0 = time.perf_counter()
                outs = engine.generate(input_ids=req["prompts"], sampling_params=req["sampling"])
                wall = time.perf_counter() - t0
                reply(ok=True, wall_s=wall, outputs=[{"output_ids": list(o["output_ids"]), "meta_info": o["meta_info"]}
                                                     for o in outs])
            elif op == "close":
                if engine is not None:
                    engine.shutdown()
                reply(ok=True)
                break
            else:
                reply(ok=False, error=f"unknown op {op!r}", kind="protocol")
        except Exception as e:  # the adapter turns this into a clear error; the traceback goes to the log
            traceback.print_exc()
            reply(ok=False, error=f"{type(e).__name__}: {e}", kind="init" if op == "init" else "run")
            if op == "init":
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
