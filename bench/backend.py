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


@dataclass
class BatchOutput:
    requests: list[RequestOutput]
    wall_s: float
    cycles: list[dict] | None = None  # CYCLE_FIELDS per cycle and row; None if the engine has no trace
    counters: dict = field(default_factory=dict)  # raw engine counters, kept beside the metrics


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
        index 0 is unused), and a note on how exact that is for this drafter. None when the engine
        or method cannot; the trace builder then says the method is unavailable."""
        return None

    def describe(self) -> dict:
        """Versions, device, dtype, threads, drafter description: written with every result."""
        return {}

    def close(self) -> None:
        pass
