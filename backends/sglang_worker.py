"""The process that runs sglang.Engine for backends/sglang.py (offline mode), started with the
interpreter that has SGLang; it imports nothing of specsweep but the stdlib-only request loop
(backends/worker_loop.py).

Requests: {"op": "init", "llm": {...sglang.Engine keyword arguments...}}, {"op": "generate",
"prompts": [[ids]], "sampling": {...SGLang sampling params...}}, {"op": "close"}. The generate
answer has each request's output_ids and meta_info as SGLang returns them.
"""
from __future__ import annotations

import time

from backends.worker_loop import serve


def main() -> int:
    state = {}

    def init(req):
        t0 = time.perf_counter()
        import sglang

        state["engine"] = sglang.Engine(**req["llm"], enable_metrics=True)  # metrics: first_token_latency
        return {"start_s": time.perf_counter() - t0, "version": sglang.__version__}

    def generate(req):
        t0 = time.perf_counter()
        outs = state["engine"].generate(input_ids=req["prompts"], sampling_params=req["sampling"])
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "outputs": [{"output_ids": list(o["output_ids"]), "meta_info": o["meta_info"]}
                                            for o in outs]}

    def close(req):
        if "engine" in state:
            state["engine"].shutdown()
        return {}

    return serve({"init": init, "generate": generate, "close": close})


if __name__ == "__main__":
    raise SystemExit(main())
