"""SGLang (`backend=sglang` offline, `backend=sglang_server` server mode). SGLang's kernels on
PyPI are CUDA builds: it runs on GPU machines only. Field names and formulas below were read from
SGLang 0.5.23's source (srt/managers/tokenizer_manager.py `_calculate_spec_decoding_metrics`,
srt/managers/schedule_batch.py, srt/observability/metrics_collector.py).

Offline: `sglang.Engine` in a worker process (backends/sglang_worker.py) started with the
interpreter that has SGLang (backend.python, $SPECSWEEP_SGLANG_PYTHON, else the running one).
Server: `python -m sglang.launch_server` on 127.0.0.1 with --enable-metrics, in a process group
of its own; a batch is its requests sent together to /generate as input_ids. One engine per
(model, speculative config) kept for the sweep process; the baseline is the same engine without
a speculative algorithm.

Acceptance from each finished request's meta_info: spec_verify_ct (verify forwards, each one a
cycle with a draft), spec_num_proposed_drafts (= spec_verify_ct x (speculative_num_draft_tokens
- 1): SGLang counts the drafted length as fixed), spec_num_correct_drafts (accepted draft
tokens, bonus excluded) and spec_correct_drafts_histogram (index j: verifies that accepted j
drafts), from which the per-position counts follow. SGLang's own spec_accept_length is
completion_tokens / spec_verify_ct: it includes the bonus token and also the token of the
prefill, so it exceeds specsweep's mean_acceptance_length (docs/metrics.md) by 1/spec_verify_ct. /metrics has no
accepted-token counter (spec_accept_length and spec_accept_rate are gauges over the last logging
window, get_server_info's average is cumulative since start): its sglang:spec_verify_calls_total
delta is kept beside the metrics as a cross-check of the summed spec_verify_ct.

| method       | SGLang                                                                       |
|--------------|------------------------------------------------------------------------------|
| ngram        | speculative_algorithm NGRAM                                                  |
| draft_model  | STANDALONE, speculative_draft_model_path = method.draft_path                 |
| eagle        | EAGLE, speculative_draft_model_path = method.head_path                       |
| eagle3       | EAGLE3, speculative_draft_model_path = method.head_path                      |
Every method drafts a chain: speculative_num_steps = k, speculative_eagle_topk = 1,
speculative_num_draft_tokens = k + 1.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.backend import (DEFAULT_DRAFT_LENGTH, Backend, BackendConfig, BatchOutput, LoadPlan, RequestOutput,
                           Sampling, SpecCounters, check_positive_seconds, checked_settings)


from .processes import Pool, ServerProcess, Worker, cli_flags
from .serving import (SGLANG_COUNTERS, Access, api_key_from_env, counter_delta, grant, read_counters, send_batch,
                      serve_load, sglang_output, sglang_request_counts)

METHODS = ("autoregressive", "ngram", "draft_model", "eagle", "eagle3")
ALGORITHMS = {"ngram": "NGRAM", "draft_model": "STANDALONE", "eagle": "EAGLE", "eagle3": "EAGLE3"}
ADAPTIVE_ALGORITHMS = ("EAGLE", "EAGLE3")  # the ones SGLang's adaptive speculative decoding runs (topk 1)
ADAPTIVE_CONFIG_FILE = "sglang_adaptive_spec.json"  # the file name the tuned schedule's flags name


@dataclass
class SGLangConfig(BackendConfig):
    """backend=sglang: SGLang offline (sglang.Engine in a worker process). Needs a CUDA GPU:
    SGLang's kernels on PyPI are CUDA builds. sglang_server (conf/backend/sglang_server.yaml) has
    the same settings."""
    _target_: str = "backends.sglang.SGLangBackend"
    name: str = "sglang"
    python: str | None = None  # null = $SPECSWEEP_SGLANG_PYTHON, else the running interpreter
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    context_length: int = 2048
    max_running_requests: int = 8  # at least the largest batch_size (or load level) of the sweep
    rows_setting = "max_running_requests"  # the sweep's pre-check holds batch_size / load level to it
    context_setting = "context_length"  # and prompt_tokens + max_new_tokens to this
    mem_fraction_static: float = 0.5  # share of GPU memory for weights and KV cache
    disable_cuda_graph: bool = False
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0  # one request (server mode) or one batch (offline)
    # server mode only: the NAME of an environment variable holding a key; the server is started
    # wanting it (SGLang's api-key, given in a private --config file, not on its command line) and
    # every request sends it
    api_key_env: str | None = None

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"backend.dtype={self.dtype!r} is not valid; use auto, float32, bfloat16 or float16")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"backend.mem_fraction_static={self.mem_fraction_static} is not valid; use a share of GPU "
                             "memory in (0, 1) for weights and KV cache")
        check_positive_seconds(startup_timeout_s=self.startup_timeout_s, request_timeout_s=self.request_timeout_s)
        for key in ("context_length", "max_running_requests"):
            if getattr(self, key) < 1:
                raise ValueError(f"backend.{key}={getattr(self, key)} is not valid; use 1 or more")


def speculative_args(method: dict, k: int) -> dict:
    """specsweep's method vocabulary as SGLang server arguments (the table above)."""
    name = method.get("name")
    if name not in METHODS:
        raise ValueError(f"method {name!r} is not supported by backend sglang; it supports {', '.join(METHODS)}")
    if name == "autoregressive":
        return {}
    args = {"speculative_algorithm": ALGORITHMS[name], "speculative_num_steps": k, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": k + 1}
    if name != "ngram":
        key = "draft_path" if name == "draft_model" else "head_path"
        if not method.get(key):
            raise ValueError(f"method {name} on backend sglang needs method.{key}: a folder SGLang can load "
                             f"({'a draft model' if name == 'draft_model' else 'an ' + name.upper() + ' head'} in the "
                             "Hugging Face layout)")
        args["speculative_draft_model_path"] = str(Path(method[key]).expanduser())
    return args


def _adaptive_top_k(method: dict, schedule: list[tuple[int, int, int]]) -> int | None:
    """The largest k of a schedule SGLang's adaptive mode can run for this method, else None."""
    top = max(k for _, _, k in schedule)
    return top if top >= 1 and ALGORITHMS.get(method.get("name")) in ADAPTIVE_ALGORITHMS else None


def engine_args(model_path: str, cfg: SGLangConfig, spec: dict) -> dict:
    """ServerArgs fields (sglang.Engine keyword arguments; launch_server's flags with - for _)."""
    return {"model_path": model_path, "dtype": cfg.dtype, "context_length": cfg.context_length,
            "max_running_requests": cfg.max_running_requests, "mem_fraction_static": cfg.mem_fraction_static,
            "disable_cuda_graph": cfg.disable_cuda_graph, "random_seed": 0, **spec}


def request_counts(meta: dict, k: int) -> tuple[int, int, int, list[int]]:
    """One finished request's meta_info as (verify steps with a draft, draft tokens, accepted
    draft tokens, accepted per draft position): serving.sglang_request_counts as a tuple."""
    c = sglang_request_counts(meta, k)
    return c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position


def batch_counters(metas: list[dict], k: int) -> SpecCounters:
    return sum((sglang_request_counts(m, k) for m in metas), SpecCounters(0, 0, 0, [0] * k))


def metrics_counters(text: str) -> dict:
    """The counters of SGLang's /metrics page (serving.read_counters), summed over labels."""
    return read_counters(text, SGLANG_COUNTERS)


def request_output(d: dict, returned_s: float, spec: bool, k: int) -> RequestOutput:
    """One /generate (or Engine.generate) result as a RequestOutput (serving.sglang_output)."""
    return sglang_output(d, returned_s, k if spec else None)


def sglang_python(configured: str | None) -> str:
    candidates = [configured] if configured else [os.environ.get("SPECSWEEP_SGLANG_PYTHON"), sys.executable]
    for py in [c for c in candidates if c]:
        if Path(py).exists() and subprocess.run([py, "-c", "import sglang"], capture_output=True).returncode == 0:
            return py
    raise ValueError(f"no SGLang in {[c for c in candidates if c]}: SGLang needs a CUDA GPU; on such a machine "
                     "`pip install sglang`, or set backend.python / SPECSWEEP_SGLANG_PYTHON to an interpreter with it")


class SGLangServer(ServerProcess):
    """One `python -m sglang.launch_server --enable-metrics` on 127.0.0.1. A key it should want
    goes in a YAML file of launch_server's --config (srt/utils/server_args_config_parser.py reads
    it at start), readable by this user only and deleted once the server is up: a key on the
    command line would be in its log and in every process listing."""

    def __init__(self, python: str, args: dict, log: Path, timeout_s: float, api_key: str | None = None):
        private = Path(tempfile.mkdtemp(prefix="specsweep-sglang-")) if api_key else None  # mode 0700
        flags = []
        if private:
            config = private / "server-args.yaml"
            fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"api-key: {json.dumps(api_key)}\n")  # a JSON string is a YAML string, quoted
            flags = ["--config", str(config)]
        try:
            super().__init__(lambda port: [python, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port",
                                           str(port), "--enable-metrics"] + cli_flags(args) + flags,
                             log, timeout_s, "SGLang's server")
        finally:
            if private:
                shutil.rmtree(private, ignore_errors=True)
        grant(self.url, Access(api_key))

    def counters(self) -> dict:
        return metrics_counters(self.metrics_page())


class SGLangBackend(Backend):
    name = "sglang"
    ttft_source, emit_granularity = "engine", "none"  # meta_info first_token_latency; results are not streamed
    supported_methods = METHODS
    config_cls = SGLangConfig
    server = False

    @classmethod
    def check_config(cls, settings: dict, model: dict, method: dict, num_speculative_tokens: int) -> None:
        from backends.native.loading import resolve_model_path  # the GGUF or folder export_hf_folder reads

        cfg = checked_settings(settings, SGLangConfig, cls.name)
        if cfg.api_key_env and not cls.server:
            raise ValueError(f"backend.api_key_env={cfg.api_key_env}: backend {cls.name} runs SGLang in process, with "
                             "no server to protect; use backend=sglang_server")
        api_key_from_env(cfg.api_key_env)
        resolve_model_path(str(model["path"]))

    @classmethod
    def resource_need(cls, settings: dict, model: dict, method: dict, num_speculative_tokens: int, rows: int,
                      tokens_per_row: int):
        """The model's context window; the engine sizes its own memory (a share of the device)."""
        from backends.model_facts import context_need
        from backends.native.loading import resolve_model_path

        return context_need(resolve_model_path(str(model["path"])))

    @classmethod
    def engine_config(cls, method: dict, k: int | None) -> list[str]:
        """SGLang's server arguments (speculative_args as launch_server flags); off: none."""
        return [] if k is None else cli_flags(speculative_args(method, k))

    @classmethod
    def engine_schedule(cls, method: dict, schedule: list[tuple[int, int, int]]) -> list[str] | None:
        """SGLang's adaptive speculative decoding with one batch-size slot per schedule entry
        (--speculative-adaptive, --speculative-adaptive-config FILE: engine_schedule_files), each
        slot's candidate_steps the one k chosen there, so nothing adapts within a slot; EAGLE and
        EAGLE3 only, topk 1; speculative_num_steps starts at the largest k."""
        top = _adaptive_top_k(method, schedule)
        if top is None:
            return None
        return cli_flags({**speculative_args(method, top), "speculative_adaptive": True,
                          "speculative_adaptive_config": ADAPTIVE_CONFIG_FILE})

    @classmethod
    def engine_schedule_files(cls, method: dict, schedule: list[tuple[int, int, int]]) -> dict[str, str]:
        """The adaptive config: keys are batch sizes, a batch routed to the largest key at or below
        its size (after CUDA-graph padding), so each entry's k holds from its first batch size up
        to the next entry's, as the schedule says; candidate_steps [0] turns drafting off there.
        Read in SGLang's source (python/sglang/srt/speculative/adaptive_spec_params.py and
        adaptive_step_router.py, main branch, 2026); releases before its batch-size slots take
        one candidate_steps list for every batch size."""
        if _adaptive_top_k(method, schedule) is None:
            return {}
        return {ADAPTIVE_CONFIG_FILE: json.dumps({str(first): {"candidate_steps": [k]} for first, _, k in schedule})}

    def __init__(self, model: dict, method: dict, num_speculative_tokens: int = DEFAULT_DRAFT_LENGTH, **settings):
        self.cfg = checked_settings(settings, SGLangConfig, self.name)
        self.method, self.k = dict(method), num_speculative_tokens
        self.spec = speculative_args(self.method, self.k)
        from backends.native.loading import export_hf_folder  # GGUF (the default model) -> HF folder, once

        self.model_path = str(export_hf_folder(str(model["path"])))
        self.python = sglang_python(self.cfg.python)
        self.logdir = Path.cwd()
        self._tokenizer = None

    def set_artifact_dir(self, path) -> None:
        self.logdir = Path(path)

    def _args(self, speculative: bool) -> dict:
        return engine_args(self.model_path, self.cfg, self.spec if speculative else {})

    def _engine(self, speculative: bool, batch: int):
        if batch > self.cfg.max_running_requests:
            raise ValueError(f"{batch} rows at once (batch_size or load level) is above backend.max_running_requests="
                             f"{self.cfg.max_running_requests}; raise it so they all run together")
        args = self._args(speculative)
        key = json.dumps([self.name, self.python, args, self.cfg.api_key_env], sort_keys=True)
        kind = self.spec.get("speculative_algorithm", "baseline") if speculative else "baseline"
        log = self.logdir / f"{self.name}-{kind}.log"
        if self.server:
            return Pool.get(key, lambda: SGLangServer(self.python, args, log, self.cfg.startup_timeout_s,
                                                      api_key_from_env(self.cfg.api_key_env)))
        return Pool.get(key, lambda: Worker(self.python, "backends.sglang_worker", args, log, self.cfg.startup_timeout_s,
                                            "SGLang"))

    def _tok(self):
        # Tokenized here, with the model's own tokenizer, so no engine is needed for it.
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    def tokenize(self, text: str) -> list[int]:
        return self._tok().encode(text, add_special_tokens=True)

    def detokenize(self, ids) -> str:
        return self._tok().decode(list(ids), skip_special_tokens=True)

    def _sampling(self, sampling: Sampling, max_new_tokens: int) -> dict:
        return {"max_new_tokens": max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k if sampling.top_k > 0 else -1, "sampling_seed": sampling.seed,
                **({"ignore_eos": True} if sampling.ignore_eos else {})}

    def generate(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool) -> BatchOutput:
        spec = speculative and bool(self.spec)
        e = self._engine(spec, len(prompts))
        if self.server:
            return self._served(e, spec, lambda: send_batch("sglang_generate", e.url, prompts, sampling, max_new_tokens,
                                                            self.cfg.request_timeout_s, "SGLang's server", e.log_tail,
                                                            k=self.k if spec else 0))
        got = e.call({"op": "generate", "prompts": [list(map(int, p)) for p in prompts],
                      "sampling": self._sampling(sampling, max_new_tokens)}, self.cfg.request_timeout_s)
        wall = got["wall_s"]
        reqs = [request_output(d, wall, spec, self.k) for d in got["outputs"]]
        sc = batch_counters([d.get("meta_info", {}) for d in got["outputs"]], self.k) if spec else None
        return BatchOutput(reqs, wall, None, counters={}, spec_counters=sc)

    def _served(self, e, spec: bool, send) -> BatchOutput:
        """A server run (send: the requests, returning (outputs, wall)): /metrics read before and
        after it, the acceptance record summed from the requests' meta_info, and the server's
        verify-call counter kept as a cross-check of it."""
        before = e.counters()
        reqs, wall = send()
        counters = counter_delta(before, e.counters())
        sc = sum((r.spec_counters for r in reqs), SpecCounters(0, 0, 0, [0] * self.k)) if spec else None
        if sc is not None and "sglang:spec_verify_calls_total" in counters:
            counters["verify_calls_match_meta_info"] = counters["sglang:spec_verify_calls_total"] == sc.drafts
        return BatchOutput(reqs, wall, None, counters=counters, spec_counters=sc)

    def describe(self) -> dict:
        return {"engine": f"sglang ({'server on 127.0.0.1' if self.server else 'offline Engine, worker process'})",
                "python": self.python, "model_resolved": self.model_path, "speculative_args": json.dumps(self.spec),
                "dtype": self.cfg.dtype, "drafter": self.method["name"],
                "time_split": "unavailable: SGLang reports no draft/verify time split"}

    def close(self) -> None:
        pass  # engines stay up for the rest of the sweep process (Pool); stopped at exit


class SGLangServerBackend(SGLangBackend):
    name = "sglang_server"
    server = True
    load_kinds = ("concurrency", "rate")  # SGLang batches continuously; a load run is streamed (sglang_stream)
    _served_load = False

    def latency_contract(self) -> dict:
        if self._served_load:  # streamed: the client's TTFT (queueing included) and a time per chunk
            return {"ttft_source": "client", "emit_granularity": "chunk"}
        return super().latency_contract()

    def serve(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool, plan: LoadPlan) -> BatchOutput:
        self._served_load = True
        spec = speculative and bool(self.spec)
        e = self._engine(spec, plan.max_rows)
        return self._served(e, spec, lambda: serve_load("sglang_stream", e.url, prompts, sampling, max_new_tokens, plan,
                                                        self.cfg.request_timeout_s, "SGLang's server", e.log_tail,
                                                        k=self.k if spec else 0))
