"""Draft/verify timing inside an unmodified vLLM, which reports no such split. Loaded in vLLM's
own processes through the vllm.general_plugins entry point of backends/vllm_plugin (installed
into vLLM's environment by `specsweep-install-vllm`), only when SPECSWEEP_VLLM_STEP_LOG names a
file. It wraps four methods of vLLM's v1 model runner (GPUModelRunner; the CPU runner inherits
them) and appends one JSON line per engine step to that file:

- t_verify: the target's forward (`_model_forward`) plus its logits (`model.compute_logits`)
  when called by the runner itself, i.e. not while drafting;
- t_draft: `propose_draft_token_ids` (the drafter: n-gram lookup, EAGLE head, draft model);
- t_other: the rest of `execute_model` + `sample_tokens` (input preparation, sampling,
  rejection, bookkeeping).

A step's drafting proposes the tokens the next step verifies; sums over steps are the same. The
step's shape comes with it: rows, scheduled tokens, scheduled draft tokens, and `decode` (every
scheduled row is in decode: one token plus its drafts). On CUDA each timed region is bracketed by
a device synchronize, which costs the overlap of asynchronous scheduling: the split is honest,
the absolute step time slightly pessimistic. Imports nothing of specsweep.
"""
from __future__ import annotations

import json
import os
import time

_installed = False


def _summary(so) -> dict:
    spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
    n = getattr(so, "num_scheduled_tokens", None) or {}
    decode = bool(n) and not getattr(so, "scheduled_new_reqs", None) and all(
        v == 1 + len(spec.get(r, ())) for r, v in n.items())
    return {"rows": len(n), "tokens": int(getattr(so, "total_num_scheduled_tokens", 0) or 0),
            "spec_tokens": int(sum(len(v) for v in spec.values())), "decode": decode}


class _StepTimer:
    """One engine process's timing of its steps: the step being timed (pending: its phase times
    and shape), whether the drafter is running (the target's forwards inside it are drafting),
    and the file each finished step is appended to."""

    def __init__(self, path: str):
        import torch

        self.torch = torch
        self.out = open(f"{path}", "a", buffering=1)  # one line per step, visible to the adapter at once
        self.step, self.pending, self.drafting = 0, None, False

    def sync(self, runner):
        if getattr(getattr(runner, "device", None), "type", None) == "cuda":
            self.torch.cuda.synchronize()

    def run_timed(self, runner, call, bucket):
        p = self.pending
        if p is None or (bucket == "verify" and self.drafting):
            return call()
        self.sync(runner)
        t0 = time.perf_counter()
        self.drafting = bucket == "draft"
        try:
            return call()
        finally:
            self.sync(runner)
            self.drafting = False
            p["t_" + bucket] += time.perf_counter() - t0

    def timed(self, fn, bucket):
        def wrapper(runner, *a, **kw):
            return self.run_timed(runner, lambda: fn(runner, *a, **kw), bucket)
        return wrapper

    def time_target_logits(self, runner):
        # The target's logits count as verification. The CPU runner has its own load_model, so
        # the model's compute_logits is wrapped on first use rather than at load.
        model = runner.model
        if getattr(model, "_specsweep_timed", False):
            return
        orig = model.compute_logits
        model.compute_logits = lambda *a, **kw: self.run_timed(runner, lambda: orig(*a, **kw), "verify")
        model._specsweep_timed = True

    def execute_model(self, orig):
        def wrapper(runner, scheduler_output, *a, **kw):
            self.time_target_logits(runner)
            self.sync(runner)
            self.pending = p = {"t_verify": 0.0, "t_draft": 0.0, "t_total": 0.0, **_summary(scheduler_output)}
            t0 = time.perf_counter()
            try:
                result = orig(runner, scheduler_output, *a, **kw)
            finally:
                self.sync(runner)
                p["t_total"] += time.perf_counter() - t0
            if result is not None:  # finished without sampling (nothing scheduled, pipeline stage): no step
                self.pending = None
            return result
        return wrapper

    def sample_tokens(self, orig):
        def wrapper(runner, *a, **kw):
            p = self.pending
            t0 = time.perf_counter()
            try:
                return orig(runner, *a, **kw)
            finally:
                if p is not None:
                    self.sync(runner)
                    self.finish(p, time.perf_counter() - t0)
        return wrapper

    def finish(self, p: dict, sampling_s: float) -> None:
        p["t_total"] += sampling_s
        p["t_other"] = max(p["t_total"] - p["t_verify"] - p["t_draft"], 0.0)
        p["step"], p["pid"] = self.step, os.getpid()
        p["threads"] = self.torch.get_num_threads()  # vLLM's CPU backend binds its own (VLLM_CPU_OMP_THREADS_BIND)
        self.step += 1
        self.pending = None
        self.out.write(json.dumps(p) + "\n")


def install(path: str) -> None:
    """Wrap the model runner's phases; idempotent (vLLM may load a plugin more than once)."""
    global _installed
    if _installed:
        return
    _installed = True
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as Runner

    t = _StepTimer(path)
    Runner.execute_model = t.execute_model(Runner.execute_model)
    Runner.sample_tokens = t.sample_tokens(Runner.sample_tokens)
    Runner._model_forward = t.timed(Runner._model_forward, "verify")
    Runner.propose_draft_token_ids = t.timed(Runner.propose_draft_token_ids, "draft")
