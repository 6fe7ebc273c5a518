"""The interface every engine adapter implements, and the records it returns.

An adapter is constructed by Hydra from its `_target_` with the model and method configs, and
knows nothing of the harness beyond this module. It returns raw observations (tokens, times,
per-cycle counts); every metric is computed from them in bench.metrics, the same way for all.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

# Columns of a per-cycle record. `row` is the request's index in the submitted batch; t_* are the
# wall times of the cycle's phases (shared by the rows of one batched cycle): t_draft proposing,
# t_verify the target's forward, t_other sampling, acceptance and bookkeeping.
CYCLE_FIELDS = ("cycle", "row", "drafted", "accepted", "emitted", "kv_len", "batch_rows", "t_draft", "t_verify", "t_other")


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@dataclass
class RequestOutput:
    output_token_ids: list[int]
    ttft_s: float  # since the batch was submitted
    e2e_s: float
    emit_times_s: list[float] = field(default_factory=list)  # when each chunk of tokens came out
    top2_margins: list[float] | None = None  # target's top-1 minus top-2 logit per output token
    finished_by: str = "length"
    drafted: int | None = None  # per-request counts, from engines without a per-cycle trace
    accepted: int | None = None


@dataclass
class SpecCounters:
    """An engine's own speculative counters over one batch (deltas), for engines that keep no
    per-cycle trace: verification steps that had a draft, draft tokens, accepted tokens, and
    accepted tokens per draft position (vLLM's and llama.cpp's counters have this shape)."""
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int] = field(default_factory=list)

    def __add__(self, o: "SpecCounters") -> "SpecCounters":
        n = max(len(self.accepted_per_position), len(o.accepted_per_position))
        pad = lambda v: list(v) + [0] * (n - len(v))  # noqa: E731
        return SpecCounters(self.drafts + o.drafts, self.draft_tokens + o.draft_tokens,
                            self.accepted_tokens + o.accepted_tokens,
                            [a + b for a, b in zip(pad(self.accepted_per_position), pad(o.accepted_per_position))])


@dataclass
class BatchOutput:
    requests: list[RequestOutput]
    wall_s: float
    cycles: list[dict] | None = None  # CYCLE_FIELDS per cycle and row; None if the engine has no trace
    counters: dict = field(default_factory=dict)  # raw engine counters, kept beside the metrics
    spec_counters: SpecCounters | None = None  # where there is no per-cycle trace
    # Where there is no per-cycle trace but the engine's steps are timed inside it (vLLM through
    # specsweep's plugin): one dict per engine step with t_draft, t_verify, t_other (as in a cycle),
    # rows, tokens, spec_tokens (draft tokens verified in it) and decode (every row decoding).
    steps: list[dict] | None = None


class BackendError(RuntimeError):
    """An engine failed on a request: the job is recorded with status=error."""


class Backend(abc.ABC):
    """One engine with one model and one method. `generate(..., speculative=False)` is the same
    engine with speculation off: the baseline a method is compared with."""

    name: str = "backend"
    supported_methods: tuple[str, ...] = ()

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def detokenize(self, ids: list[int]) -> str: ...

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: Sampling, max_new_tokens: int, speculative: bool) -> BatchOutput:
        """Run the prompts as one batch (all submitted together)."""

    def draft_predictions(self, sequences: list[list[int]]) -> tuple[list[list[int]], str] | None:
        """Teacher forcing, for acceptance traces: for each token sequence, the configured drafter's
        greedy prediction of every token given the true prefix (index t predicts sequences[t];
        index 0 is unused), or, for drafters whose later drafts depend on their own earlier ones
        (EAGLE heads), a [len, k] array whose row t is the k-token chain drafted for tokens t, t+1,
        ...; and a note on how exact that is. None when the engine or method cannot; the trace
        builder then says the method is unavailable."""
        return None

    def set_artifact_dir(self, path) -> None:
        """Where the engine may keep files of this job (server logs): the job's folder."""

    def describe(self) -> dict:
        """Versions, device, dtype, threads, drafter description: written with every result."""
        return {}

    def close(self) -> None:
        pass


def instantiate_backend(backend_cfg: dict, model: dict, method: dict, num_speculative_tokens: int) -> Backend:
    """Build the engine adapter named by the backend config's `_target_` (Hydra instantiation)."""
    from hydra.utils import instantiate

    cfg = {k: v for k, v in backend_cfg.items() if k != "name"}
    return instantiate(cfg, model=model, method=method, num_speculative_tokens=num_speculative_tokens, _convert_="all")
