"""The process that runs vLLM for backends/vllm.py. It is started with the interpreter that has
vLLM installed (often a virtual environment of its own, since vLLM pins its own torch), imports
nothing of specsweep, and speaks JSON lines: requests on stdin, one answer per request on the file
descriptor named by SPECSWEEP_ANSWER_FD (vLLM logs to stdout and stderr, which the adapter saves).

Requests: {"op": "init", "llm": {...vllm.LLM keyword arguments...}}, {"op": "generate",
"prompts": [[ids]], "sampling": {...}}, {"op": "tokenize", "text"}, {"op": "detokenize", "ids"},
{"op": "close"}. Answers: {"ok": true, ...} or {"ok": false, "error", "kind"}.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                 "vllm:spec_decode_num_accepted_tokens_per_pos")


def counters(llm) -> dict:
    """vLLM's speculative counters, cumulative since the engine started (the adapter takes deltas)."""
    out = {}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[m.name] = list(m.values) if hasattr(m, "values") else m.value
    return out


def main() -> int:
    answer = os.fdopen(int(os.environ.get("SPECSWEEP_ANSWER_FD", "3")), "w", buffering=1)
    llm = None

    def reply(**kw):
        answer.write(json.dumps(kw) + "\n")

    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "init":
                t0 = time.perf_counter()
                import vllm
                from vllm import LLM

                llm = LLM(**req["llm"])
                reply(ok=True, start_s=time.perf_counter() - t0, version=vllm.__version__)
            elif op == "generate":
                from vllm import SamplingParams

                s = req["sampling"]
                params = SamplingParams(max_tokens=s["max_tokens"], temperature=s["temperature"], top_p=s["top_p"],
                                        top_k=s["top_k"] if s["top_k"] > 0 else -1, seed=s.get("seed"), ignore_eos=False)
                before = counters(llm)
                t0 = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params, use_tqdm=False)
                wall = time.perf_counter() - t0
                after = counters(llm)
                reqs = []
                for o in outs:
                    m = o.metrics
                    ttft = getattr(m, "first_token_latency", None)
                    span = (m.last_token_ts - m.first_token_ts) if m is not None else None
                    reqs.append({"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
                                 "ttft_s": ttft, "e2e_s": None if ttft is None or span is None else ttft + span})
                reply(ok=True, wall_s=wall, requests=reqs, before=before, after=after)
            elif op == "tokenize":
                reply(ok=True, ids=llm.get_tokenizer().encode(req["text"], add_special_tokens=True))
            elif op == "detokenize":
                reply(ok=True, text=llm.get_tokenizer().decode(req["ids"], skip_special_tokens=True))
            elif op == "close":
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
