"""The interface every engine adapter implements, and the records it returns.

An adapter is constructed by Hydra from its `_target_` with the model and method configs, and
knows nothing of the harness beyond this module. It returns raw observations (tokens, times,
per-cycle counts); every metric is computed from them in bench.metrics, the same way for all.
"""
from __future__ import annotations

import abc
import contextlib
import fcntl
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import ClassVar


class LockBusy(RuntimeError):
    """file_lock(wait=False) found the lock held by another process."""


@contextlib.contextmanager
def file_lock(path: Path, wait: bool = True, on_wait=None):
    """An exclusive lock between processes, held for the block (parallel launchers share a results
    folder; parallel sweeps or test workers share the user cache). wait=False: LockBusy at once
    if another process holds it (a run that refuses rather than queues); on_wait(): called once
    before waiting (to say who is waited for). The kernel drops it with its holder, however that
    process ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise LockBusy(f"{path} is held by another process") from None
            if on_wait is not None:
                on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cache_root() -> Path:
    """The one user cache (SPECSWEEP_CACHE, else the platform's cache folder for specsweep), shared
    by the harness (sweep pace) and every adapter (probes, converted weights, derived drafts)."""
    import platformdirs  # the platform's convention (~/.cache on Linux), not a path of ours

    return Path(os.environ.get("SPECSWEEP_CACHE", platformdirs.user_cache_dir("specsweep")))

# Columns of a per-cycle record. `row` is the request's index in the submitted batch; t_* are the
# wall times of the cycle's phases (shared by the rows of one batched cycle): t_draft proposing,
# t_verify the target's forward, t_other sampling, acceptance and bookkeeping.
CYCLE_FIELDS = ("cycle", "row", "drafted", "accepted", "emitted", "kv_len", "batch_rows", "t_draft", "t_verify", "t_other")


# The draft length k when none is given: SweepConfig's num_speculative_tokens (bench/config.py)
# and every adapter's constructor (tests and notebooks build adapters directly) read it here.
DEFAULT_DRAFT_LENGTH = 4


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # Generate max_new_tokens whatever the model's end-of-sequence token says (the output-length
    # axis: a run of 2k new tokens must have them); every engine honours it, both arms alike.
    ignore_eos: bool = False


@dataclass
class RequestOutput:
    output_token_ids: list[int]
    ttft_s: float | None  # as the adapter's ttft_source says; None where the engine did not report it
    e2e_s: float | None  # since the batch was submitted
    emit_times_s: list[float] = field(default_factory=list)  # when each chunk came out (emit_granularity)
    finished_by: str = "length"
    drafted: int | None = None  # per-request counts, from engines without a per-cycle trace
    accepted: int | None = None
    spec_counters: "SpecCounters | None" = None  # the request's whole acceptance record, where the engine gives one
    # Under load (Backend.serve): when the request was submitted, in seconds since the load run
    # began; its ttft_s, e2e_s and emit_times_s then count from that moment. A static batch: 0.
    submitted_s: float = 0.0
    # A request that failed while others of its run were answered: the kind of failure (http_500,
    # http_429, disconnected: the connection closed mid-answer, connect: refused, timeout), with
    # no output. A run whose every request failed is an error of the engine instead.
    error: str | None = None


@dataclass
class SpecCounters:
    """The one acceptance record every acceptance metric is computed from (bench.metrics.acceptance):
    drafts (verification steps that had a draft), draft tokens, accepted tokens, accepted tokens
    per draft position; and, where the engine can tell, how many drafts reached each position
    (had at least j+1 tokens) and how many drafts had a token at position j with every token
    before it accepted. Filled from per-cycle traces (bench.metrics.counts_from_cycles), or from an
    engine's own counters over one batch (deltas; vLLM's and llama.cpp's have the first four
    fields, not the last two: None)."""
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] | None = None
    reached_per_position: list[int] | None = None

    @staticmethod
    def accepted_from_histogram(hist, k: int) -> list[int]:
        """Accepted draft tokens per position 1..k from a histogram of verify steps by how many
        drafts they accepted (hist[j]: the steps that accepted exactly j): position p is accepted
        in every step that accepted p drafts or more (SGLang's spec_correct_drafts_histogram,
        vLLM's per-request acceptance_histogram, AIPerf's pooled one)."""
        hist = [int(n) for n in hist]
        return [sum(hist[p:]) for p in range(1, k + 1)]

    def __add__(self, o: "SpecCounters") -> "SpecCounters":
        def add(a, b):
            if a is None or b is None:
                return None
            n = max(len(a), len(b))
            return [x + y for x, y in zip(list(a) + [0] * (n - len(a)), list(b) + [0] * (n - len(b)))]

        return SpecCounters(self.drafts + o.drafts, self.draft_tokens + o.draft_tokens,
                            self.accepted_tokens + o.accepted_tokens,
                            add(self.accepted_per_position, o.accepted_per_position),
                            add(self.drafts_per_position, o.drafts_per_position),
                            add(self.reached_per_position, o.reached_per_position))


@dataclass
class BatchOutput:
    requests: list[RequestOutput]
    wall_s: float
    cycles: list[dict] | None = None  # CYCLE_FIELDS per cycle and row; None if the engine has no trace
    counters: dict = field(default_factory=dict)  # raw engine counters, kept beside the metrics
    spec_counters: SpecCounters | None = None  # where there is no per-cycle trace
    # When spec_counters are the requests' own (summed from each response), the engine's aggregate
    # counters over the same batch (a server's /metrics deltas): compared with them, never used,
    # since they also count any other client's requests the server served meanwhile.
    aggregate_counters: SpecCounters | None = None
    # Where there is no per-cycle trace but the engine's steps are timed inside it (vLLM through
    # specsweep's plugin): one dict per engine step with t_draft, t_verify, t_other (as in a cycle),
    # rows, tokens, spec_tokens (draft tokens verified in it) and decode (every row decoding).
    steps: list[dict] | None = None


@dataclass
class ResourceNeed:
    """A job's need, estimated before any model loads (Backend.resource_need). The memory parts
    are what the engine will hold at the job's largest batch and length: a floor, not a ceiling
    (activations and the engine's own overhead come on top), so a job over the memory free is
    certain not to fit."""
    context_tokens: int | None = None  # the model's context window (its config); None: not known here
    context_source: str = ""  # where that figure comes from (a config key), for the error that quotes it
    memory_bytes: dict[str, int] = field(default_factory=dict)  # part ("weights", "KV cache", ...) -> bytes
    memory_device: str = "cpu"  # where that memory is taken: cpu (host RAM) or cuda[:N]
    advice: str = ""  # a setting of this engine that lowers the need (said when a job does not fit)


@dataclass
class LoadPlan:
    """When the requests of a load run are submitted (bench/load.py builds it from the `load`
    config). concurrency: a closed loop, `concurrency` requests outstanding at all times (request
    i+N is submitted when one of the N in flight finishes), in request order. rate: an open loop,
    request i submitted arrivals_s[i] seconds after the run began, whatever is in flight then.
    max_rows: the most requests the engine is asked to run at once (its slots, rows or sequences):
    the concurrency, or for a rate the `load.max_rows` given; requests beyond it wait in the
    engine's (or the scheduler's) queue, and their TTFT includes that wait."""
    kind: str  # "concurrency" | "rate"
    max_rows: int
    concurrency: int | None = None
    arrivals_s: list[float] | None = None

    @classmethod
    def batch(cls, n: int) -> "LoadPlan":
        """A static batch as a plan: all n requests submitted at once, n rows."""
        return cls("concurrency", max_rows=n, concurrency=n)


def check_positive_seconds(**values) -> None:
    """Each named backend setting is a positive number of seconds, else a ValueError naming it."""
    for key, value in values.items():
        if value <= 0:
            raise ValueError(f"backend.{key}={value} is not valid; use a positive number of seconds")


@dataclass
class BackendConfig:
    """What every adapter's settings have: the adapter class (Hydra's `_target_`) and the name rows
    carry. Each adapter subclasses it with its own settings, their defaults written there once and
    their values checked in __post_init__; bench/config.py registers each subclass as the typed
    Hydra node `backend=<name>` (backends/__init__.py lists them), so a value of the wrong type is
    refused as the sweep is composed, and the adapter is constructed with its settings as keyword
    arguments, checked by `checked_settings`."""
    _target_: str = "???"  # OmegaConf's MISSING: a subclass names its adapter
    name: str = "???"
    # The setting that caps how many requests the engine runs at once (vLLM's max_num_seqs), where
    # one does: the sweep's pre-check refuses a batch_size or load level above it before any job runs.
    rows_setting: ClassVar[str | None] = None
    # The setting that caps the tokens a request may hold (prompt + output + a draft), and whether
    # it is per row (llama-server's ctx_per_slot, vLLM's max_model_len) or shared by the rows of a
    # batch (llama.cpp's n_ctx): with prompt_tokens set, the pre-check refuses a length it cannot hold.
    context_setting: ClassVar[str | None] = None
    context_shared_by_rows: ClassVar[bool] = False

    @classmethod
    def setting_names(cls) -> list[str]:
        """The settings a user may give (backend.<key>), in declared order."""
        import dataclasses

        return [f.name for f in dataclasses.fields(cls) if f.name not in ("_target_", "name")]


def reject_unknown(settings: dict, valid, backend: str) -> None:
    """A backend setting nobody reads is a typo (or a `+key=` Hydra suggested): refused, with the
    valid keys, rather than silently ignored."""
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise ValueError(f"backend.{unknown[0]} is not a setting of backend {backend}"
                         + (f" (nor {', '.join(unknown[1:])})" if unknown[1:] else "") + f"; valid: {', '.join(valid)}")


def checked_settings(settings: dict, config_cls: type[BackendConfig], backend: str | None = None):
    """An adapter's settings (the backend config less `_target_` and `name`) as its config
    dataclass: an unknown key refused with the valid ones, each value checked by the dataclass's
    own __post_init__. backend: the name errors give (default: the config's own)."""
    settings = {k: v for k, v in settings.items() if k not in ("_target_", "name")}
    reject_unknown(settings, config_cls.setting_names(), backend or config_cls.name)
    return config_cls(**settings)


class SettingError(ValueError):
    """A setting the engine cannot honour, found only when the job runs (a load level above the
    slots of a server someone else started): the job's configuration error (error_kind=config)."""


class BackendError(RuntimeError):
    """An engine failed on a request: the job is recorded with status=error. returncode: how the
    engine's process ended, where it did (negative: killed by that signal); None otherwise."""

    def __init__(self, message: str, returncode: int | None = None):
        super().__init__(message)
        self.returncode = returncode


class EngineTimeout(BackendError):
    """An engine gave no answer in time (a request, or the whole job): status=timeout."""


class Backend(abc.ABC):
    """One engine with one model and one method. `generate(..., speculative=False)` is the same
    engine with speculation off: the baseline a method is compared with."""

    name: str = "backend"
    config_cls: type[BackendConfig] = BackendConfig  # its settings (backend.<key>) and their defaults
    supported_methods: tuple[str, ...] = ()
    # The latency contract (docs/metrics.md, "Latency"). ttft_source: where RequestOutput.ttft_s comes
    # from: "client" (the time since the batch was submitted at which the first token was seen by
    # the caller), "engine" (the engine's own figure, e.g. prompt processing only, no queueing), or
    # "unavailable". emit_granularity: what emit_times_s stamps: "token", "chunk" (a streamed
    # chunk), "cycle" (a draft/verify cycle's tokens at once) or "none" (no times between first and
    # last). The harness computes TTFT, TPOT and ITL only where these make them meaningful.
    ttft_source: str = "unavailable"
    emit_granularity: str = "none"

    def latency_contract(self) -> dict:
        """The contract for this adapter's method (an adapter whose paths differ overrides it)."""
        return {"ttft_source": self.ttft_source, "emit_granularity": self.emit_granularity}

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def detokenize(self, ids: list[int]) -> str: ...

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: Sampling, max_new_tokens: int, speculative: bool) -> BatchOutput:
        """Run the prompts as one batch (all submitted together)."""

    # The load kinds `serve` supports besides "static" (generate): "concurrency", "rate".
    load_kinds: tuple[str, ...] = ()

    def serve(self, prompts: list[list[int]], sampling: Sampling, max_new_tokens: int, speculative: bool,
              plan: LoadPlan) -> BatchOutput:
        """Serve the prompts as the plan submits them, the engine batching continuously (a request
        joins as a row frees; finished rows leave): one BatchOutput for the whole run, its requests
        in prompt order with their submitted_s, wall_s from the run's start to the last answer,
        cycles (if traced) with batch_rows the rows each verify served."""
        raise NotImplementedError(f"backend {self.name} serves no load but static batches")

    def draft_predictions(self, sequences: list[list[int]], with_probs: bool = False) -> tuple | None:
        """Teacher forcing, for acceptance traces: for each token sequence, the configured drafter's
        greedy prediction of every token given the true prefix (index t predicts sequences[t];
        index 0 is unused), or, for drafters whose later drafts depend on their own earlier ones
        (EAGLE heads), a [len, k] array whose row t is the k-token chain drafted for tokens t, t+1,
        ...; and a note on how exact that is: (predictions, note). with_probs: (predictions, note,
        probabilities), the last shaped like the predictions, the drafter's probability of each
        predicted token (its softmax at the chosen token; NaN where nothing is predicted), or None
        in that place where the engine cannot give them. None when the engine or method cannot
        predict at all; the trace builder then says the method is unavailable."""
        return None

    def margins_across_shapes(self, prefix: list[int], preferred: int, other: int, shapes: list[int]) -> list[float] | None:
        """The engine's own numerics at one decision, speculation off: log p(preferred) - log
        p(other) as the next token after `prefix`, once per batch shape in `shapes` (n: the prefix's
        last n tokens forwarded together, its start already cached; 0: the whole prefix in one
        forward, or in the pieces the engine prefills a long prompt in); NaN for a shape where
        either token is not among those the engine lists. The lossless check asks it where a
        greedy output diverged away from a near-tie (a verify batch is one more shape). None: the
        engine cannot score a prefix under chosen shapes."""
        return None

    @classmethod
    def check_config(cls, settings: dict, model: dict, method: dict, num_speculative_tokens: int) -> None:
        """Check this engine's settings (the backend config less _target_ and name), the model and
        the method's files without loading anything: a ValueError or FileNotFoundError naming the
        bad value and what is valid. Run for every job of a sweep before the first one starts.
        Here: the settings against config_cls (an adapter that checks more does so too, first)."""
        checked_settings(settings, cls.config_cls, cls.name)

    @classmethod
    def resource_need(cls, settings: dict, model: dict, method: dict, num_speculative_tokens: int, rows: int,
                      tokens_per_row: int) -> "ResourceNeed":
        """What a job of `rows` requests at once, each holding at most `tokens_per_row` tokens (its
        prompt, its output and a draft past it), asks of the model and the machine, from the
        model's files and the settings, without loading anything (the sweep's pre-check holds it to
        the model's context and the memory free). Default: nothing known."""
        return ResourceNeed()

    @classmethod
    def engine_config(cls, method: dict, k: int | None) -> list[str] | None:
        """How a user runs `method` at draft length k on this engine, in the engine's own syntax:
        the command-line arguments (vLLM's --speculative-config JSON, SGLang's server arguments,
        llama-server's flags, specsweep's overrides) as a list, k None for speculation off ([]:
        the engine's defaults are off). From the same mapping the adapter runs the method with. A
        ValueError names what the method lacks on this engine (a draft model's path); None: the
        adapter cannot say (the engine is configured outside specsweep)."""
        return None

    @classmethod
    def engine_schedule(cls, method: dict, schedule: list[tuple[int, int, int]]) -> list[str] | None:
        """How a user runs `method` with a draft length per batch size on this engine, in its own
        syntax: schedule is [(first batch size, last batch size, k), ...] (inclusive, from batch 1,
        k 0 for off). None: the engine takes no such schedule."""
        return None

    @classmethod
    def engine_schedule_files(cls, method: dict, schedule: list[tuple[int, int, int]]) -> dict[str, str]:
        """Files the engine_schedule arguments name, as {file name: its text}; most engines none."""
        return {}

    @classmethod
    def baseline_key(cls, method: dict) -> dict:
        """What of the method config changes this engine's baseline path (the same engine with
        speculation off): part of a shared baseline's identity, so that two methods whose
        baselines differ never share one. Most engines: nothing."""
        return {}

    def weight_bytes_per_step(self) -> int | None:
        """Bytes of weights one decode step of the target reads (every matrix once): with the
        machine's read bandwidth this gives the baseline's roofline step time. None where the
        adapter cannot tell."""
        return None

    def matmul_flops_per_token(self) -> tuple[int, str] | None:
        """The compute side of the roofline: FLOPs of the target's matrix products per token (2 x
        the elements of every matrix a token is multiplied by, the output matrix included, an
        embedding lookup not) and the torch dtype they run in, whose peak product rate the harness
        measures. None where the adapter cannot tell, or where its kernels are not torch's (a
        quantized GGUF's integer dot products run at another peak than any torch product)."""
        return None

    def set_artifact_dir(self, path) -> None:
        """Where the engine may keep files of this job (server logs): the job's folder."""

    def describe(self) -> dict:
        """Versions, device, dtype, threads, drafter description: written with every result. An
        engine that serves a model of its own choosing (a running deployment) names it as
        `served_model`, and the row's `model` is that name instead of the config's."""
        return {}

    def close(self) -> None:
        pass


def instantiate_backend(backend_cfg: dict, model: dict, method: dict, num_speculative_tokens: int) -> Backend:
    """Build the engine adapter named by the backend config's `_target_` (Hydra instantiation)."""
    from hydra.utils import instantiate

    from hydra.errors import InstantiationException

    cfg = {k: v for k, v in backend_cfg.items() if k != "name"}
    try:
        return instantiate(cfg, model=model, method=method, num_speculative_tokens=num_speculative_tokens, _convert_="all")
    except InstantiationException as e:  # the adapter's own error (a bad value, a missing file) says what to fix
        raise (e.__cause__ if isinstance(e.__cause__, Exception) else e) from None
