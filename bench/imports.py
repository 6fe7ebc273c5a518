"""`specsweep-import FILE... --out DIR`: the result files of the field's other tools, read into
specsweep's rows (one JobKey each, every metric under docs/metrics.md's definitions), so that the
report, the plots and the gate work on them as on a sweep of specsweep's own.

Each format is read as its tool writes it (the keys and units below were read from each tool's
own source, the version named):

| format | tool | one run is | latency | acceptance |
|---|---|---|---|---|
| vllm-bench | `vllm bench serve --save-result` JSON (vLLM 0.32; also `--append-result` lines and `vllm bench sweep`'s summary.json list) | the file (a line, a list item) | `median_/p90_/p99_{ttft,tpot,itl,e2el}_ms` (ms) | the server's /metrics deltas: `spec_decode_num_drafts`, `_draft_tokens`, `_accepted_tokens`, `_per_position_acceptance_rates` (fractions of drafts) |
| aiperf | AIPerf 0.13 `profile_export_aiperf.json` (+ `profile_export.jsonl` beside it, per request) | the file | `time_to_first_token`, `inter_token_latency` (vLLM's TPOT), `request_latency`: `p50/p90/p99` (ms) | `pooled_spec_decode_acceptance_histogram` {accepted drafts: steps}; per request `spec_decode_acceptance` |
| guidellm | GuideLLM 0.8 `benchmarks.json` | each benchmark (strategy) | `time_to_first_token_ms`, `inter_token_latency_ms` (vLLM's TPOT; GuideLLM's `time_per_output_token_ms` counts the first token), `request_latency` (s): `successful.percentiles` | per request `response_metrics.speculative_decoding` (vLLM's per-request block) |
| spec-bench | Spec-Bench answer JSONL (`model_answer/*.jsonl`) | the file | none (not streamed) | `accept_lengths` per decoding step (bonus token included) |

What a file does not hold is NaN (or, for the identity, taken from a flag and said so in the
row's `imported_from`); nothing is invented. With `--baseline FILE...` (the same tool's run of
the same deployment without speculation), each run is paired with the baseline run at the same
load point: speedup = its output tokens/s over the baseline's, tpot_speedup = the baseline's p50
TPOT over its own; one run per arm gives no interval (the interval columns stay empty).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .backend import SpecCounters
from .jsonl import read_jsonl
from .methods import speculates
from .metrics import acceptance
from .results import JobKey, build_index, short_hash, write_json
from .summary import checked_row

TOOLS = ("vllm-bench", "aiperf", "guidellm", "spec-bench")


class UnreadableResultFile(ValueError):
    """A file that cannot be read as the format it is taken for: names the file and what is wrong."""


@dataclass
class Run:
    """One measured run of another tool: one arm at one load point, as read (seconds, tokens)."""
    tool: str
    source: str
    model: str | None = None
    load_kind: str = "concurrency"  # concurrency (incl. one at a time) or rate
    load_level: float | None = None
    requests: int | None = None
    output_tokens: int | None = None
    max_output_len: int | None = None
    tokens_per_s: float = math.nan
    request_throughput: float = math.nan
    goodput_rps: float = math.nan
    latency_s: dict = field(default_factory=dict)  # {"ttft_p50": s, "tpot_p90": s, ...}
    counters: SpecCounters | None = None
    k: int | None = None
    request_alpha: list = field(default_factory=list)  # per-request acceptance rate, where the file has it
    temperature: float | None = None
    workload: str | None = None
    notes: list = field(default_factory=list)


# ------------------------------------------------------------------ readers, one per format

def _pct(d: dict, metric: str, scale: float) -> dict:
    """{metric_p50, _p90, _p99} in seconds from vLLM bench's median_/pNN_<metric>_ms keys."""
    out = {}
    for q, keys in (("p50", (f"median_{metric}_ms", f"p50_{metric}_ms")), ("p90", (f"p90_{metric}_ms",)),
                    ("p99", (f"p99_{metric}_ms",))):
        v = next((d[k] for k in keys if isinstance(d.get(k), (int, float))), None)
        if v is not None:
            out[f"{metric.replace('e2el', 'e2e')}_{q}"] = float(v) * scale
    return out


def _vllm_run(d: dict, source: str) -> Run:
    conc, rate = d.get("max_concurrency"), d.get("request_rate")
    finite_rate = isinstance(rate, (int, float)) and math.isfinite(rate)
    run = Run("vllm-bench", source, model=d.get("model_id"), requests=d.get("completed"),
              load_kind="rate" if finite_rate else "concurrency",
              load_level=float(rate) if finite_rate else (float(conc) if conc else None),
              output_tokens=d.get("total_output_tokens"), tokens_per_s=float(d.get("output_throughput", math.nan)),
              request_throughput=float(d.get("request_throughput", math.nan)),
              goodput_rps=float(d["request_goodput"]) if isinstance(d.get("request_goodput"), (int, float)) else math.nan)
    for m in ("ttft", "tpot", "itl", "e2el"):
        run.latency_s.update(_pct(d, m, 1e-3))
    if d.get("output_lens"):
        run.max_output_len = int(max(d["output_lens"]))
    if d.get("failed"):
        run.notes.append(f"{d['failed']} request(s) failed (not in the figures)")
    if run.load_level is None:
        run.notes.append("max_concurrency unset and request_rate inf: every request at once (level = requests)")
        run.load_level = float(d.get("num_prompts") or d.get("completed") or 0)
    drafts = d.get("spec_decode_num_drafts")
    if drafts:
        rates = list(d.get("spec_decode_per_position_acceptance_rates") or [])
        run.counters = SpecCounters(int(drafts), int(d["spec_decode_draft_tokens"]), int(d["spec_decode_accepted_tokens"]),
                                    [round(r * drafts) for r in rates])
        run.k = len(rates) or None
        run.notes.append("acceptance from the server's /metrics deltas over the run (any other traffic included)")
    return run


def read_vllm_bench(path: Path) -> list[Run]:
    text = path.read_text()
    try:
        data = json.loads(text)
        items = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:  # --append-result: one JSON object per line
        items = [d for _, d in read_jsonl(path, UnreadableResultFile)]
    return [_vllm_run(d, f"{path}" + (f"[{i}]" if len(items) > 1 else "")) for i, d in enumerate(items)]


def _histogram_counters(hist: dict, k: int | None, draft_tokens: int | None = None) -> SpecCounters:
    """{accepted drafts j: steps} -> the acceptance record (steps accepting at least p tokens per
    position). Every step drafted k tokens unless draft_tokens (the file's count) says fewer were
    drafted: how many steps reached each position is then unknown (the per-position basis is all
    drafts)."""
    h = {int(j): int(n) for j, n in hist.items()}
    k = k or max(h)
    steps = sum(h.values())
    accepted = sum(j * n for j, n in h.items())
    per_pos = SpecCounters.accepted_from_histogram([h.get(j, 0) for j in range(max(max(h), k) + 1)], k)
    full = draft_tokens is None or draft_tokens == steps * k
    return SpecCounters(steps, steps * k if draft_tokens is None else int(draft_tokens), accepted, per_pos,
                        drafts_per_position=[steps] * k if full else None,
                        reached_per_position=[steps] + per_pos[:-1] if full else None)


def read_aiperf(path: Path) -> list[Run]:
    d = json.loads(path.read_text())
    stat = lambda tag, key="avg": (d.get(tag) or {}).get(key)  # noqa: E731
    cfg = d.get("input_config") or {}
    models = ((cfg.get("models") or {}).get("items") or [{}])
    phase = next((p for p in cfg.get("phases") or [] if p.get("name") != "warmup"), {})
    datasets = cfg.get("datasets") or [{}]
    run = Run("aiperf", str(path), model=models[0].get("name"), requests=stat("request_count"),
              workload=datasets[0].get("type") or datasets[0].get("name"),
              tokens_per_s=float(stat("output_token_throughput") or math.nan),
              request_throughput=float(stat("request_throughput") or math.nan),
              goodput_rps=float(stat("goodput") or math.nan))
    if phase.get("rate") and phase.get("type") != "concurrency":
        run.load_kind, run.load_level = "rate", float(phase["rate"])
    else:
        run.load_level = float(phase.get("concurrency") or 1)
    for ours, tag in (("ttft", "time_to_first_token"), ("tpot", "inter_token_latency"), ("e2e", "request_latency")):
        for q in ("p50", "p90", "p99"):
            if isinstance(stat(tag, q), (int, float)):
                run.latency_s[f"{ours}_{q}"] = stat(tag, q) * 1e-3
    run.output_tokens = stat("output_sequence_length", "sum")
    run.max_output_len = stat("output_sequence_length", "max")
    per_request = path.parent / "profile_export.jsonl"
    if per_request.exists():
        for _, rec in read_jsonl(per_request, UnreadableResultFile):
            sd = rec.get("spec_decode_acceptance")
            if sd and (rec.get("metadata") or {}).get("benchmark_phase", "profiling") == "profiling":
                run.k = run.k or sd.get("num_spec_tokens")
                if sd.get("num_draft_tokens"):
                    run.request_alpha.append(sd["num_accepted_draft_tokens"] / sd["num_draft_tokens"])
    if d.get("pooled_spec_decode_acceptance_histogram"):
        run.counters = _histogram_counters(d["pooled_spec_decode_acceptance_histogram"], run.k,
                                           stat("spec_decode_draft_tokens", "sum"))
        run.k = run.k or len(run.counters.accepted_per_position)
        run.notes.append("acceptance from the server's per-request spec-decode metrics")
    return [run]


def _guidellm_run(b: dict, spec: dict, source: str) -> Run:
    m = b.get("metrics") or {}
    ok = lambda name: (m.get(name) or {}).get("successful") or {}  # noqa: E731
    strategy = (b.get("config") or {}).get("strategy") or {}
    kind = strategy.get("type_")
    data = spec.get("data") or [{}]
    run = Run("guidellm", source, model=(spec.get("backend") or {}).get("model"),
              workload=(data[0] or {}).get("kind") if isinstance(data[0], dict) else None,
              requests=(m.get("request_totals") or {}).get("successful"),
              tokens_per_s=float(ok("output_tokens_per_second").get("mean", math.nan)),
              request_throughput=float(ok("requests_per_second").get("mean", math.nan)))
    if kind in ("constant", "poisson"):
        run.load_kind, run.load_level = "rate", float(strategy.get("rate"))
    else:  # synchronous (one at a time), concurrent (streams), throughput (all at once, up to max_concurrency)
        run.load_level = float(strategy.get("streams") or strategy.get("max_concurrency") or 1)
        if kind == "throughput":
            run.notes.append("GuideLLM's throughput strategy: every request at once, up to max_concurrency")
    for ours, name, scale in (("ttft", "time_to_first_token_ms", 1e-3), ("tpot", "inter_token_latency_ms", 1e-3),
                              ("e2e", "request_latency", 1.0)):
        pct = ok(name).get("percentiles") or {}
        for q in ("p50", "p90", "p99"):
            if isinstance(pct.get(q), (int, float)):
                run.latency_s[f"{ours}_{q}"] = pct[q] * scale
    reqs = (b.get("requests") or {}).get("successful") or []
    run.output_tokens = int(sum(r.get("output_tokens") or 0 for r in reqs)) or None
    run.max_output_len = max((r.get("output_tokens") or 0 for r in reqs), default=None) or None
    _per_request_spec(run, [((r.get("response_metrics") or {}).get("speculative_decoding")) for r in reqs])
    return run


def _per_request_spec(run: Run, blocks: list) -> None:
    """vLLM's per-request speculative_decoding blocks, summed into the run's acceptance record."""
    blocks = [s for s in blocks if s and s.get("num_spec_steps")]
    if not blocks:
        return
    run.k = int(blocks[0].get("num_spec_tokens") or 0) or None
    hist: dict[int, int] = {}
    for s in blocks:
        if s.get("num_draft_tokens"):
            run.request_alpha.append(s["num_accepted_draft_tokens"] / s["num_draft_tokens"])
        for j, n in enumerate(s.get("acceptance_histogram") or []):
            hist[j] = hist.get(j, 0) + int(n)
    if hist:
        run.counters = _histogram_counters(hist, run.k, sum(s.get("num_draft_tokens") or 0 for s in blocks))
    else:
        run.counters = SpecCounters(sum(s["num_spec_steps"] for s in blocks), sum(s["num_draft_tokens"] for s in blocks),
                                    sum(s["num_accepted_draft_tokens"] for s in blocks))
    run.notes.append("acceptance from vLLM's per-request spec-decode metrics")


def read_guidellm(path: Path) -> list[Run]:
    d = json.loads(path.read_text())
    spec = (d.get("config") or {}).get("spec") or {}
    benches = [b for b in d.get("benchmarks") or [] if b.get("type_", "generative_benchmark") == "generative_benchmark"]
    return [_guidellm_run(b, spec, f"{path}[{i}]" if len(benches) > 1 else str(path)) for i, b in enumerate(benches)]


def read_spec_bench(path: Path) -> list[Run]:
    answers = [a for _, a in read_jsonl(path, UnreadableResultFile)]
    tokens = wall = 0.0
    steps: list[int] = []
    for n, a in enumerate(answers, 1):
        choice = (a.get("choices") or [{}])[0]
        if "new_tokens" not in choice or "wall_time" not in choice:
            raise UnreadableResultFile(f"{path}, line {n}: a Spec-Bench answer has choices[0].new_tokens and .wall_time")
        tokens += sum(choice["new_tokens"])
        wall += sum(choice["wall_time"])
        steps += [int(x) for x in choice.get("accept_lengths") or []]
    run = Run("spec-bench", str(path), model=answers[0].get("model_id") if answers else None, requests=len(answers),
              load_level=1.0, output_tokens=int(tokens), tokens_per_s=tokens / wall if wall else math.nan,
              workload="spec_bench")
    run.notes.append("Spec-Bench runs one question at a time; its own speedup is a ratio of mean per-answer speeds, "
                     "this one of total tokens over total time")
    if steps and max(steps) > 1:
        hist: dict[int, int] = {}
        for length in steps:  # accept length includes the bonus token
            hist[length - 1] = hist.get(length - 1, 0) + 1
        run.counters = _histogram_counters(hist, None)
        run.k = len(run.counters.accepted_per_position)
        run.notes.append("draft length not recorded: k taken as the longest accept length less one")
    return [run]


READERS = {"vllm-bench": read_vllm_bench, "aiperf": read_aiperf, "guidellm": read_guidellm, "spec-bench": read_spec_bench}


def detect(path: Path) -> str:
    """Which tool wrote a file, from its keys; an UnreadableResultFile naming the formats otherwise."""
    text = path.read_text(errors="replace")
    head = text.lstrip()[:1]
    try:
        d = json.loads(text)
    except json.JSONDecodeError:
        first = next((json.loads(x) for x in text.splitlines() if x.strip()), None) if head == "{" else None
        if isinstance(first, dict) and "choices" in first and "question_id" in first:
            return "spec-bench"
        if isinstance(first, dict) and "endpoint_type" in first:
            return "vllm-bench"
        d = None
    if isinstance(d, list) and d and isinstance(d[0], dict) and "endpoint_type" in d[0]:
        return "vllm-bench"
    if isinstance(d, dict):
        if "aiperf_version" in d or isinstance(d.get("time_to_first_token"), dict):
            return "aiperf"
        if isinstance(d.get("benchmarks"), list):
            return "guidellm"
        if "endpoint_type" in d and "request_throughput" in d:
            return "vllm-bench"
        if "choices" in d and "question_id" in d:
            return "spec-bench"
    raise UnreadableResultFile(f"{path}: not a result file of a known tool; known: vllm bench serve JSON, AIPerf "
                               "profile_export_aiperf.json, GuideLLM benchmarks.json, Spec-Bench answer JSONL "
                               "(or name it with --tool, one of " + ", ".join(TOOLS) + ")")


# ------------------------------------------------------------------ rows

def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._" else "_" for c in str(text))[:60]


def _identity(run: Run, a) -> JobKey:
    static = {"backend": a.engine or run.tool, "model": a.model or run.model or "unknown",
              "method": a.method or ("imported" if run.counters else "autoregressive"),
              "workload": a.workload or run.workload or Path(run.source.split("[")[0]).stem}
    level = run.load_level or 0
    return JobKey(**static, batch_size=int(level) if run.load_kind == "concurrency" else 0,
                  temperature=float(a.temperature if a.temperature is not None else run.temperature),
                  top_p=1.0, top_k=0, num_speculative_tokens=int(a.k or run.k or 0),
                  max_new_tokens=int(a.max_new_tokens or run.max_output_len or 0), num_prompts=int(run.requests or 0),
                  seed=0, config_hash=short_hash({"imported": run.tool}))


def _acceptance_columns(run: Run, k: int) -> dict:
    if run.counters is None:
        return {}
    out = {**acceptance(run.counters, k), "acceptance_counts": vars(run.counters)}
    if run.request_alpha:
        alpha = np.asarray(run.request_alpha, dtype=float)
        out.update(request_acceptance_mean=float(alpha.mean()), request_acceptance_p10=float(np.quantile(alpha, 0.1)),
                   request_acceptance_p50=float(np.quantile(alpha, 0.5)), request_acceptance_p90=float(np.quantile(alpha, 0.9)))
    return out


def _paired_columns(run: Run, base: Run) -> dict:
    """The baseline arm's columns and the ratios (one run each: no interval)."""
    ratio = lambda a, b: a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan  # noqa: E731
    out = {"baseline_tokens_per_s": base.tokens_per_s, "speedup": ratio(run.tokens_per_s, base.tokens_per_s),
           "baseline_request_throughput": base.request_throughput, "baseline_output_tokens_per_s": base.tokens_per_s,
           "baseline_goodput_rps": base.goodput_rps, "goodput_ratio": ratio(run.goodput_rps, base.goodput_rps),
           "baseline_from": base.source}
    out.update({f"baseline_{k}": v for k, v in base.latency_s.items()})
    if "tpot_p50" in run.latency_s and "tpot_p50" in base.latency_s:
        out["tpot_speedup"] = ratio(base.latency_s["tpot_p50"], run.latency_s["tpot_p50"])
    return out


def to_row(run: Run, base: Run | None, a) -> dict:
    """A specsweep row (bench/summary.py's columns) of one imported run, paired with its baseline's."""
    key = _identity(run, a)
    label = (f"c{run.load_level:g}" if run.load_kind == "concurrency" else f"r{run.load_level:g}")
    job = "-".join(_safe(x) for x in (key.backend, key.model, key.method, key.workload, label)) + "-" + short_hash(
        [vars(key), run.source])[:8]
    notes = list(run.notes) + ([] if run.temperature is not None else
                               [f"temperature not in the file: {key.temperature:g} from --temperature"])
    speculative = run.counters is not None or (a.method is not None and speculates(a.method))
    row = {**vars(key), "job": job, "status": "ok", "speculative": speculative, "lossless": "n/a",
           "load_kind": run.load_kind, "load_level": run.load_level, "load_label": label, "repeats": 1,
           "imported_from": f"{run.tool}: {run.source}" + (f" ({'; '.join(notes)})" if notes else ""),
           "tokens_per_s": run.tokens_per_s, "output_tokens": run.output_tokens, "request_throughput": run.request_throughput,
           "output_tokens_per_s": run.tokens_per_s, "goodput_rps": run.goodput_rps, "drafter": key.method,
           "engine": {"engine": key.backend, "imported": run.tool}, **run.latency_s,
           **_acceptance_columns(run, key.num_speculative_tokens)}
    if base is not None:
        row.update(_paired_columns(run, base))
    return checked_row(row)


def read_runs(paths, tool: str | None) -> list[Run]:
    runs = []
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise UnreadableResultFile(f"{p}: no such file")
        name = tool or detect(p)
        try:
            runs += READERS[name](p)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if isinstance(e, UnreadableResultFile):
                raise
            raise UnreadableResultFile(f"{p}: not readable as {name} ({type(e).__name__}: {e})") from None
    return runs


def import_files(paths, out: Path, a) -> list[dict]:
    """Read every file (and the baselines), pair each run with the baseline at its load point, write
    one job folder per run under `out` and the sweep's index; returns the rows."""
    from .results import write_manifest

    runs, bases = read_runs(paths, a.tool), read_runs(a.baseline or [], a.tool)
    unknown = [r.source for r in runs + bases if r.temperature is None and a.temperature is None]
    if unknown:
        raise UnreadableResultFile(f"{unknown[0]} does not record the sampling temperature; pass --temperature T (what the "
                           "tool asked the server for; vllm bench serve sends none unless given --temperature, so "
                           "the server's default applies)")
    by_point = {(b.tool, b.load_kind, b.load_level): b for b in bases}  # a baseline of the same tool and load
    rows = []
    for run in runs:
        base = by_point.get((run.tool, run.load_kind, run.load_level))
        if bases and base is None:
            run.notes.append(f"no baseline run at {run.load_kind} {run.load_level:g}")
        row = to_row(run, base, a)
        jdir = Path(out) / row["job"]
        write_json(jdir / "summary.json", row)
        write_manifest(jdir, ("summary.json",))
        rows.append(row)
    build_index(Path(out))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specsweep-import", description=(
        "Read the result files of vllm bench serve, AIPerf, GuideLLM and Spec-Bench into specsweep's rows (one job "
        "folder each), so specsweep-report and specsweep-gate run on them."))
    ap.add_argument("files", nargs="+", help="result files: vllm bench serve JSON (or its --append-result lines, or "
                    "vllm bench sweep's summary.json), AIPerf profile_export_aiperf.json, GuideLLM benchmarks.json, "
                    "Spec-Bench answer JSONL")
    ap.add_argument("--out", required=True, help="the folder to write (a sweep folder: one job per run, index.csv)")
    ap.add_argument("--baseline", nargs="+", metavar="FILE", help="the same tool's run(s) without speculation: each "
                    "run is paired with the baseline run at its load point (speedup, tpot_speedup, goodput_ratio)")
    ap.add_argument("--tool", choices=TOOLS, help="the format (default: recognized from the file's keys)")
    ap.add_argument("--engine", help="the engine measured, as the rows' backend (default: the tool's name)")
    ap.add_argument("--model", help="the model's name in the rows (default: the file's)")
    ap.add_argument("--method", help="the speculative method's name (default: imported, or autoregressive for a run "
                    "without speculation)")
    ap.add_argument("--workload", help="the workload's name (default: the file's dataset, or its name)")
    ap.add_argument("--temperature", type=float, help="the sampling temperature the tool asked for (required when "
                    "the file does not record it, as none of these formats does)")
    ap.add_argument("--k", type=int, help="draft length (default: the file's, where it has one)")
    ap.add_argument("--max-new-tokens", type=int, help="output length asked for (default: the longest output seen)")
    a = ap.parse_args(argv)
    for flag in ("k", "max_new_tokens"):
        if getattr(a, flag) is not None and getattr(a, flag) < 0:
            ap.error(f"--{flag.replace('_', '-')}={getattr(a, flag)}: use 0 or more")
    if a.temperature is not None and a.temperature < 0:
        ap.error(f"--temperature={a.temperature}: use 0 (greedy) or a positive value")
    try:
        rows = import_files(a.files, Path(a.out), a)
    except UnreadableResultFile as e:
        print(f"specsweep-import: {e}", file=sys.stderr)
        return 2
    for r in rows:
        print(f"{r['job']}: tokens/s {r['tokens_per_s']:.4g}, speedup {r.get('speedup', math.nan):.3g}, "
              f"acceptance {r.get('acceptance_rate', math.nan):.3g}, tau {r.get('mean_acceptance_length', math.nan):.3g}")
    print(f"{len(rows)} run(s) written to {a.out} (specsweep-report {a.out}; specsweep-gate {a.out} --baseline FILE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
