"""One job's summary row, every column declared once.

`JobSummary` is the record behind results/<sweep>/<job>/summary.json and the sweep's index: the
identity (its JobKey fields first), how the job was measured, and every metric, each with what it
holds (the formulas are in docs/metrics.md, the section named). The views (the CLI's table, the
report's summary, what the gate records) are lists of these names, kept here too. A column
nobody declared is logged and kept when a job runs (nothing measured is dropped), and is an error
under SPECSWEEP_STRICT_COLUMNS=1, which the tests set: a new metric is declared here or a test fails.

docs/columns.md is generated from this file (`python -m bench.summary > docs/columns.md`; a test
checks it is current).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

from .results import JobKey

log = logging.getLogger("specsweep")


class _Absent:
    """A column the job did not write (a load metric on a static job): left out of the row, unlike None."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()


def col(doc: str, section: str = "") -> Any:
    return field(default=ABSENT, metadata={"doc": doc, "section": section})


# headings of docs/metrics.md, named beside the columns they define (a test checks each exists)
ACCEPT, SPEED, ROOF = "The acceptance record", "Speedup and its interval", "Baseline efficiency (roofline)"
AA = "The A/A control"
COST, LAT, LOAD = "Cost ratios and the prediction", "Latency: one contract", "Under load (`load=concurrency`, `load=rate`)"
LOSSLESS, ERRORS = "Losslessness", "Errors"
POSITION = "Input length and output position"


@dataclass(frozen=True)
class JobSummary(JobKey):
    # --- how the job was run -------------------------------------------------------------------
    repeats: int = col("timed repeats of every batch, each arm")
    baseline_mode: str = col("paired (baseline and method batch by batch, alternating) or shared (one baseline per engine setting, reused)", SPEED)
    prompt_tokens: int = col("the input length asked for (prompt_tokens), in the target's tokens; empty: the workload's own lengths", POSITION)
    prompt_tokens_median: float = col("the prompts' median length as measured, in the target's tokens (requests.parquet n_prompt)", POSITION)
    aa_control: bool = col("an A/A control: the method arm is the same engine without speculation, through the method arm's code path", AA)
    speculative: bool = col("whether the method speculates (its config's speculative); false for the baseline method and for A/A controls")
    load_kind: str = col("static (batches of batch_size), concurrency (a closed loop) or rate (an open loop of gamma-distributed arrivals)", LOAD)
    load_level: float = col("the load's level: requests in flight (concurrency) or per second (rate); null when static")
    load_label: str = col("the load point as tables and job names read it: static, c4 (concurrency 4), r1.5 (1.5 requests/s)")
    job: str = col("the job's folder name under the sweep")
    status: str = col("ok, partial (under load some requests failed: request_errors; the figures rest on the answered ones), error, timeout or skipped (a workload whose data is not on this machine)", ERRORS)
    error: str = col("the error, one line; null when ok")
    error_kind: str = col("config (a bad value found while the job was set up), engine (the engine failed) or internal (a bug in measuring)", ERRORS)
    traceback: str = col("the file holding the failure's traceback")
    method_ignored_keys: list = col("knobs of other methods in a multi-method sweep, not passed to this one")
    imported_from: str = col("a row read by specsweep-import: the tool and file it came from, and what the file did not hold")
    # --- the engine --------------------------------------------------------------------------------
    baseline_from: str = col("this job (paired) or the shared baseline's folder it reused")
    baseline_id: str = col("the shared baseline measurement's identity (a re-measured one gets a new id)")
    baseline_drift: float = col("shared baseline: its throughput measured again now over when first measured, less 1", SPEED)
    engine: dict = col("the adapter's description: versions, device, dtype, threads, drafter, kernels or compile mode")
    drafter: str = col("what drafted, in words")
    ttft_source: str = col("where TTFT comes from: client, engine or unavailable", LAT)
    emit_granularity: str = col("what a time between tokens is per: token, chunk, cycle or none", LAT)
    latency_note: str = col("what of the latency contract this engine's figures cannot give, in words")
    # --- the baseline against its roofline ---------------------------------------------------------
    baseline_step_ms: float = col("median baseline decode step, ms", ROOF)
    roofline_step_ms: float = col("the fastest a baseline step can be: the larger of the memory and compute rooflines, ms", ROOF)
    baseline_roofline_share: float = col("roofline_step_ms / baseline_step_ms: far below 1 is a slow baseline", ROOF)
    roofline_bound: str = col("which roofline is the larger at the baseline's rows: memory or compute", ROOF)
    memory_roofline_step_ms: float = col("weight bytes a step reads / the read bandwidth, ms", ROOF)
    compute_roofline_step_ms: float = col("matmul FLOPs per token x baseline_step_rows / the peak product rate, ms (null where the engine gives no FLOPs)", ROOF)
    baseline_step_rows: float = col("median rows (tokens) of a baseline decode step", ROOF)
    read_bandwidth_gbs: float = col("the device's read bandwidth, GB/s: median of the job's probes", ROOF)
    read_bandwidth_probes: int = col("bandwidth probes the job took (before the model loaded, after each repeat)")
    read_bandwidth_readings: list = col("each bandwidth probe's reading in order taken, GB/s (the first before the model loaded)")
    read_bandwidth_spread: float = col("(max - min) / median of the job's bandwidth probes: how much the machine moved")
    peak_gflops: float = col("the device's peak matrix-product rate in the engine's dtype, GFLOP/s: median of the job's probes", ROOF)
    weight_bytes_per_step: int = col("bytes of weights one target decode step reads (every matrix once)")
    matmul_flops_per_token: int = col("FLOPs of the target's matrix products per token (2 x their elements)")
    baseline_step_source: str = col("baseline cycles, engine-timed baseline steps, the requests' median TPOT, or unavailable")
    # --- speed -------------------------------------------------------------------------------------
    baseline_tokens_per_s: float = col("baseline output tokens per second, median over repeats")
    tokens_per_s: float = col("the method's output tokens per second, median over repeats")
    speedup: float = col("the method's throughput over the baseline's (paired: a ratio of sums over the pairs)", SPEED)
    speedup_ci_low: float = col("95% bootstrap interval of speedup, low end (null with one pair)", SPEED)
    speedup_ci_high: float = col("95% bootstrap interval of speedup, high end", SPEED)
    speedup_pairs: int = col("baseline/method batch pairs behind a paired speedup")
    pairs: list = col("those pairs as measured: repeat, batch, which arm ran first, and the pair's own speedup")
    pairs_baseline_first: int = col("pairs whose baseline ran first (paired jobs)", AA)
    pairs_method_first: int = col("pairs whose method ran first", AA)
    speedup_baseline_first: float = col("speedup over the pairs whose baseline ran first alone", AA)
    speedup_method_first: float = col("speedup over the pairs whose method ran first alone", AA)
    aa_verdict: str = col("A/A controls: holds 1.0 (every interval of speedup, tpot_speedup, goodput_ratio holds 1.0), excludes 1.0 with those that do not, or no interval", AA)
    output_tokens: int = col("output tokens of the method's requests, all repeats")
    # --- latency over the method's requests (static batches: p50/p95/p99) ---------------------------
    ttft_p50: float = col("time to first token, median, s", LAT)
    ttft_p90: float = col("time to first token, 90th percentile, s (load runs)")
    ttft_p95: float = col("time to first token, 95th percentile, s")
    ttft_p99: float = col("time to first token, 99th percentile, s")
    tpot_p50: float = col("time per output token after the first, median, s", LAT)
    tpot_p90: float = col("time per output token, 90th percentile, s (load runs)")
    tpot_p95: float = col("time per output token, 95th percentile, s")
    tpot_p99: float = col("time per output token, 99th percentile, s")
    itl_p50: float = col("time between emissions (per emit_granularity), median, s", LAT)
    itl_p90: float = col("time between emissions, 90th percentile, s (load runs)")
    itl_p95: float = col("time between emissions, 95th percentile, s")
    itl_p99: float = col("time between emissions, 99th percentile, s")
    e2e_p50: float = col("request latency, submission to last token, median, s (load runs)", LOAD)
    e2e_p90: float = col("request latency, 90th percentile, s (load runs)")
    e2e_p99: float = col("request latency, 99th percentile, s (load runs)")
    # --- the draft/verify cycle --------------------------------------------------------------------
    tokens_per_forward: float = col("decode tokens / decode target forwards, plain steps included", ACCEPT)
    verify_fraction: float = col("share of decode cycle time spent verifying", COST)
    draft_fraction: float = col("share of decode cycle time spent drafting", COST)
    other_fraction: float = col("share of decode cycle time in neither (host work, bookkeeping)", COST)
    time_split: str = col("where the split came from when the engine keeps no cycle trace, or why there is none")
    # --- losslessness ------------------------------------------------------------------------------
    acceptance_forced: bool = col("method=synthetic: acceptance forced at the verifier, so the output is not the target's", LOSSLESS)
    lossless: str = col("greedy: true when every output equals the baseline's but at near-ties; false; or n/a", LOSSLESS)
    lossless_divergences: int = col("requests that diverged from the baseline away from a near-tie", LOSSLESS)
    lossless_near_ties: int = col("requests that diverged at a near-tie: asked afterwards, the engine's decode step prefers the baseline's token over the method's by less than lossless_margin_tol (decode_margin in lossless_detail)", LOSSLESS)
    lossless_shape_ties: int = col("requests that diverged where the engine's own batch shapes move the margin across zero or by at least its size (margins_across_shapes in lossless_detail)", LOSSLESS)
    lossless_detail: list = col("per divergence: request, repeat, position, top-2 margin, near tie or not; away from a near-tie, the margin under several batch shapes and whether that makes it a shape tie")
    # --- acceptance --------------------------------------------------------------------------------
    acceptance_rate: float = col("alpha: accepted draft tokens / draft tokens", ACCEPT)
    mean_acceptance_length: float = col("tau: 1 + accepted tokens / drafts (the bonus token included)", ACCEPT)
    per_position_acceptance: list = col("per draft position j: of the drafts that reached j, the share that accepted it", ACCEPT)
    conditional_acceptance: list = col("per position j: acceptance of j given every earlier draft token was accepted", ACCEPT)
    per_position_basis: str = col("the per-position denominator used: drafts that reached the position, or all drafts", ACCEPT)
    acceptance_counts: dict = col("the raw acceptance record (drafts, draft and accepted tokens, per-position counts)", ACCEPT)
    engine_counters: dict = col("the engine's own speculative counters, summed over runs (engines without a cycle trace)")
    acceptance_cross_check: str = col("servers that return each request's acceptance: whether the responses' own counts equal the server's /metrics deltas (they differ when another client used the server meanwhile; the row reports the responses')", ACCEPT)
    request_acceptance_mean: float = col("alpha per request, mean over requests", ACCEPT)
    request_acceptance_p10: float = col("alpha per request, 10th percentile")
    request_acceptance_p50: float = col("alpha per request, median")
    request_acceptance_p90: float = col("alpha per request, 90th percentile")
    drafted_share: float = col("share of cycles that had a draft at all", ACCEPT)
    draft_sources: dict = col("combined and adaptive methods: per drafter, its share of cycles and its acceptance")
    acceptance_by_output_bucket: dict = col("per output-position bucket (tokens 0-255, 256-1023, 1024-4095, 4096+): acceptance_rate, mean_acceptance_length, cycles and tokens of the cycles that started there; engines with a per-cycle trace", POSITION)
    cost_by_context: dict = col("per context band (KV tokens 0-1023, 1024-4095, 4096-16383, 16384+): the baseline's median decode step in ms and the method's verify cost ratio there (full-k verifies over the baseline's step); engines with a per-cycle trace", POSITION)
    speedup_by_output_bucket: dict = col("per output-position bucket both arms reached: method tokens/s over baseline tokens/s of the decode cycles there (a batched cycle's time shared by its rows)", POSITION)
    # --- cost ratios -------------------------------------------------------------------------------
    verify_cost_ratio: float = col("r: median verify time of full-k cycles / median baseline step at that batch shape", COST)
    draft_cost_ratio: float = col("c: median draft time of full-k cycles / k / median baseline step", COST)
    predicted_speedup: float = col("(1 - alpha^(k+1)) / (1 - alpha) / (k c + r)", COST)
    # --- under load: the method's arm, the baseline's arm, and their ratios ---------------------------
    request_throughput: float = col("requests answered per second, median over repeats", LOAD)
    output_tokens_per_s: float = col("output tokens per second of the served load, median over repeats", LOAD)
    goodput_rps: float = col("requests per second that met both SLOs", LOAD)
    slo_met_share: float = col("share of requests that met both SLOs (a failed request missed them)", LOAD)
    request_error_rate: float = col("share of both arms' submitted requests that failed (a status other than 200, a connection closed or refused, no answer in time); their figures rest on the answered ones", LOAD)
    request_errors: dict = col("failed requests by arm and kind, e.g. {spec: {http_500: 3}}; null when none failed", LOAD)
    mean_in_flight: float = col("requests in flight, time-averaged over the run", LOAD)
    mean_running_batch: float = col("rows a verify (or engine decode step) served, averaged", LOAD)
    baseline_request_throughput: float = col("request_throughput of the baseline arm")
    baseline_output_tokens_per_s: float = col("output_tokens_per_s of the baseline arm")
    baseline_goodput_rps: float = col("goodput_rps of the baseline arm")
    baseline_slo_met_share: float = col("slo_met_share of the baseline arm")
    baseline_ttft_p50: float = col("ttft_p50 of the baseline arm")
    baseline_ttft_p90: float = col("ttft_p90 of the baseline arm")
    baseline_ttft_p99: float = col("ttft_p99 of the baseline arm")
    baseline_tpot_p50: float = col("tpot_p50 of the baseline arm")
    baseline_tpot_p90: float = col("tpot_p90 of the baseline arm")
    baseline_tpot_p99: float = col("tpot_p99 of the baseline arm")
    baseline_e2e_p50: float = col("e2e_p50 of the baseline arm")
    baseline_e2e_p90: float = col("e2e_p90 of the baseline arm")
    baseline_e2e_p99: float = col("e2e_p99 of the baseline arm")
    baseline_itl_p50: float = col("itl_p50 of the baseline arm")
    baseline_itl_p90: float = col("itl_p90 of the baseline arm")
    baseline_itl_p99: float = col("itl_p99 of the baseline arm")
    baseline_mean_in_flight: float = col("mean_in_flight of the baseline arm")
    baseline_mean_running_batch: float = col("mean_running_batch of the baseline arm")
    tpot_speedup: float = col("median over repeats of each repeat's baseline p50 TPOT / method p50 TPOT", LOAD)
    tpot_speedup_low: float = col("the lowest of the repeats' own TPOT ratios", LOAD)
    tpot_speedup_high: float = col("the highest of the repeats' own TPOT ratios", LOAD)
    tpot_speedup_ci_low: float = col("95% interval of tpot_speedup over requests: a cluster bootstrap of request ids, both arms together", LOAD)
    tpot_speedup_ci_high: float = col("its upper end", LOAD)
    goodput_ratio: float = col("goodput_rps / baseline_goodput_rps", LOAD)
    goodput_ratio_low: float = col("the lowest of the repeats' own goodput ratios", LOAD)
    goodput_ratio_high: float = col("the highest of the repeats' own goodput ratios", LOAD)
    goodput_ratio_ci_low: float = col("95% interval of goodput_ratio (a ratio of medians over repeats): a cluster bootstrap over repeats, both arms of a repeat together", LOAD)
    goodput_ratio_ci_high: float = col("its upper end", LOAD)
    tpot_speedup_baseline_first: float = col("median of the TPOT ratios of the repeats whose baseline ran first", AA)
    tpot_speedup_method_first: float = col("median of the TPOT ratios of the repeats whose method ran first", AA)
    goodput_ratio_baseline_first: float = col("median of the goodput ratios of the repeats whose baseline ran first", AA)
    goodput_ratio_method_first: float = col("median of the goodput ratios of the repeats whose method ran first", AA)
    slo_ttft_ms: float = col("the TTFT SLO the goodput counts against, ms (null: none)")
    slo_tpot_ms: float = col("the TPOT SLO the goodput counts against, ms (null: none)")
    # --- the machine -------------------------------------------------------------------------------
    wall_s: float = col("the job's wall time, s (setup and warm-up included)")
    peak_rss_mib: float = col("the sweep process's peak resident memory, MiB")
    loadavg_start: list = col("the machine's 1/5/15-minute load average as the job started")
    loadavg_end: list = col("the load average as it ended")
    time: str = col("when the job started (UTC, ISO 8601)")
    cpu: str = col("the CPU model")
    git_commit: str = col("specsweep's commit")
    threads: int = col("the engine's thread count, as it reports it")
    engine_version: str = col("the engine's version")
    package_versions: dict = col("versions of the packages that decide the figures")
    env: dict = col("the full environment snapshot at the job's start")
    # --- added when a sweep's rows are read ---------------------------------------------------------
    job_dir: str = col("the folder the row was read from (results.load_summaries)")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_row(cls, row: dict) -> "JobSummary":
        """The record of a summary row; a column not declared here is a ValueError naming it."""
        unknown = [k for k in row if k not in _NAMES]
        if unknown:
            raise ValueError(f"column(s) {', '.join(unknown)} not declared in bench/summary.py JobSummary")
        return cls(**row)

    def to_row(self) -> dict:
        """The row as summary.json holds it: declared order, the columns the job did not write left out."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not ABSENT}


_NAMES = frozenset(JobSummary.names())


def checked_row(row: dict) -> dict:
    """A job's row through its record, in declared order. An undeclared column is kept at the end
    with a warning (what a job measured is never dropped), or a ValueError under
    SPECSWEEP_STRICT_COLUMNS=1 (the tests)."""
    extra = {k: v for k, v in row.items() if k not in _NAMES}
    if extra:
        msg = f"column(s) {', '.join(extra)} not declared in bench/summary.py JobSummary"
        if os.environ.get("SPECSWEEP_STRICT_COLUMNS") == "1":
            raise ValueError(msg)
        log.warning("%s; kept in the row", msg)
    return {**JobSummary.from_row({k: v for k, v in row.items() if k in _NAMES}).to_row(), **extra}


# --- views: which columns each output shows, in its order -----------------------------------------
TABLE_COLUMNS = ("backend", "method", "workload", "batch_size", "num_speculative_tokens", "temperature", "status", "speedup", "acceptance_rate",
                 "mean_acceptance_length", "verify_fraction", "draft_fraction",
                 "baseline_roofline_share", "lossless")  # the CLI's table after a sweep (120 columns)
REPORT_COLUMNS = ("method", "workload", "batch_size", "temperature", "num_speculative_tokens", "status", "speedup",
                  "speedup_ci_low", "speedup_ci_high", "predicted_speedup", "acceptance_rate", "mean_acceptance_length",
                  "tokens_per_forward", "verify_fraction", "draft_fraction", "verify_cost_ratio", "draft_cost_ratio",
                  "tokens_per_s", "baseline_tokens_per_s", "baseline_roofline_share", "baseline_drift", "lossless",
                  "load_label")  # the report's summary table
GATE_NUMERIC = ("acceptance_rate", "mean_acceptance_length", "speedup", "speedup_ci_low", "speedup_ci_high",
                "tokens_per_s", "baseline_tokens_per_s")  # the gate compares these within tolerances
GATE_RECORDED = ("status", "lossless", "acceptance_rate", "mean_acceptance_length", "per_position_acceptance", "speedup",
                 "speedup_ci_low", "speedup_ci_high", "tokens_per_s", "baseline_tokens_per_s")  # what a gate baseline keeps

for _view in (TABLE_COLUMNS, REPORT_COLUMNS, GATE_NUMERIC, GATE_RECORDED):
    assert set(_view) <= _NAMES, set(_view) - _NAMES


def markdown() -> str:
    """docs/columns.md: every column, what it holds, and where docs/metrics.md defines it."""
    key = {f.name for f in fields(JobKey)}
    lines = ["# The columns of a job's row", "",
             "Generated from `bench/summary.py` (`python -m bench.summary > docs/columns.md`): every column of",
             "`summary.json` and the sweep's index, in the order a row holds them. A job leaves out the",
             "columns that do not apply to it (the load columns on a static batch).", "",
             "| column | holds | defined in |", "|---|---|---|"]
    for f in fields(JobSummary):
        if f.name in ("backend", "model", "method", "workload"):
            doc = f"identity (JobKey): the name of the job's {f.name} config"
        elif f.name == "config_hash":
            doc = "identity (JobKey): a digest of the backend, model, method and workload configs' other values"
        elif f.name in key:
            doc = f"identity (JobKey): the job's `{f.name}` setting"
        else:
            doc = f.metadata["doc"]
        sec = f.metadata.get("section", "")
        where = f"[{sec.replace('`', '')}](metrics.md#{_anchor(sec)})" if sec else ""
        lines.append(f"| `{f.name}` | {doc} | {where} |")
    return "\n".join(lines) + "\n"


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_").replace(" ", "-")


if __name__ == "__main__":
    print(markdown(), end="")
