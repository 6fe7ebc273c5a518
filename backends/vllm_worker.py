"""The process that runs vLLM for backends/vllm.py. It is started with the interpreter that has
vLLM installed (often a virtual environment of its own, since vLLM pins its own torch) and
imports nothing of specsweep but the stdlib-only request loop (backends/worker_loop.py).

Requests: {"op": "init", "llm": {...vllm.LLM keyword arguments...}}, {"op": "generate",
"prompts": [[ids]], "sampling": {...}}, {"op": "tokenize", "text"}, {"op": "detokenize", "ids"},
{"op": "close"}.
"""
from __future__ import annotations

import time

from backends.worker_loop import serve

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
    state = {}

    def init(req):
        t0 = time.perf_counter()
        import vllm

        state["llm"] = vllm.LLM(**req["llm"])
        return {"start_s": time.perf_counter() - t0, "version": vllm.__version__}

    def generate(req):
        from vllm import SamplingParams

        llm, s = state["llm"], req["sampling"]
        params = SamplingParams(max_tokens=s["max_tokens"], temperature=s["temperature"], top_p=s["top_p"],
                                top_k=s["top_k"] if s["top_k"] > 0 else -1, seed=s.get("seed"), ignore_eos=bool(s.get("ignore_eos")))
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
        return {"wall_s": wall, "requests": reqs, "before": before, "after": after}

    return serve({
        "init": init,
        "generate": generate,
        "tokenize": lambda req: {"ids": state["llm"].get_tokenizer().encode(req["text"], add_special_tokens=True)},
        "detokenize": lambda req: {"text": state["llm"].get_tokenizer().decode(req["ids"], skip_special_tokens=True)},
        "close": lambda req: {},
    })


if __name__ == "__main__":
    raise SystemExit(main())
