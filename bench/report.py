"""`specsweep-report RESULTS_DIR`: PNG plots and a markdown summary of a sweep.

Plots: under load, TPOT speedup against the load level and p50 TPOT against throughput (SD on
and off), with the crossover in the summary; speedup vs batch size per method and workload (95%
intervals, static batches); per-position acceptance;
stacked draft/verify/other share of a cycle; predicted vs measured speedup; acceptance vs
temperature when temperature was swept.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .plotting import save  # first: it sets matplotlib's Agg backend (files only, no display)

import matplotlib.pyplot as plt  # noqa: E402, I001
import matplotlib.ticker  # noqa: E402
import pandas as pd  # noqa: E402

from . import lengths_report, speculation_profile  # noqa: E402
from .html_report import write_html
from .methods import speculative_rows
from .results import find_sweep_dirs, load_summaries
from .summary import REPORT_COLUMNS, JobSummary

SLOW_BASELINE = 0.5  # a baseline below half its roofline: its speedups may come from the slow baseline
PROBE_SPREAD = 0.25  # bandwidth probes of one job further apart than this: the roofline itself moved
DRIFT_LIMIT = 0.10  # a shared baseline whose first batch, measured again, moved more than this


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v).replace("|", "/")


def markdown_table(df: pd.DataFrame, cols: list[str]) -> str:
    cols = [c for c in cols if c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(_fmt(r[c]) for c in cols) + " |")
    return "\n".join(lines)


# Series told apart without colour (a grayscale print, a colour-blind reader): each gets its own
# marker and line style as well as its colour, in this order.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINES = ("-", "--", ":", "-.")


def styles():
    """An endless sequence of (marker, linestyle) pairs, no two alike for the first 8 series."""
    i = 0
    while True:
        yield {"marker": MARKERS[i % len(MARKERS)], "linestyle": LINES[(i // 2) % len(LINES)]}
        i += 1


def _who(r, multi_backend: bool) -> str:
    return f"{r.backend}/{r.method}" if multi_backend else f"{r.method}"


def _multi(df) -> bool:
    return "backend" in df.columns and df.backend.nunique() > 1


def _ok(df, *required):
    """Completed jobs, with a value in each of the required columns."""
    d = df[df.status == "ok"].copy() if "status" in df.columns else df
    return d.dropna(subset=list(required)) if len(d) and required else d


def _loaded(df) -> pd.Series:
    """Rows of load points (load=concurrency|rate), not static batches."""
    return df.load_kind.fillna("static") != "static" if "load_kind" in df.columns else pd.Series(False, index=df.index)


def plot_speedup_vs_batch(df, out: Path) -> Path | None:
    d = _ok(df)
    d = d[speculative_rows(d) & ~_loaded(d)] if len(d) else d
    if d.empty:
        return None
    workloads = sorted(d.workload.unique())
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 3.6), squeeze=False, sharey=True)
    multi = _multi(d)
    for ax, w in zip(axes[0], workloads):
        style = styles()
        for (b, m, t), g in d[d.workload == w].groupby(["backend", "method", "temperature"]):
            g = g.sort_values("batch_size")
            err = [g.speedup - g.speedup_ci_low, g.speedup_ci_high - g.speedup]
            ax.errorbar(g.batch_size, g.speedup, yerr=err, capsize=3, label=f"{b + '/' if multi else ''}{m} (T={t:g})",
                        **next(style))
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(title=w, xlabel="batch size", xscale="log", xticks=sorted(d.batch_size.unique()))
        ax.set_xticklabels([str(b) for b in sorted(d.batch_size.unique())])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # log scale: no "2x10^0" between
    axes[0][0].set_ylabel("speedup vs same engine, no speculation")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Speedup vs batch size (median, 95% interval)")
    return save(fig, out, "speedup_vs_batch")


def plot_per_position(df, out: Path) -> Path | None:
    d = _ok(df)
    d = d[d.per_position_acceptance.map(lambda v: isinstance(v, list) and len(v) > 0)] if len(d) else d
    if d.empty:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    multi = _multi(d)
    # jobs whose curves are the same numbers (batch 1 and 4 of one method often accept alike) are
    # one line with every job named, not lines drawn over each other
    curves: dict[tuple, list[str]] = {}
    for _, r in d.sort_values([c for c in ("workload", "method", "batch_size") if c in d.columns]).iterrows():
        vals = tuple(round(v, 4) if v is not None else math.nan for v in r.per_position_acceptance)
        curves.setdefault(vals, []).append(f"{_who(r, multi)}/{r.workload}/b{r.batch_size}/T{r.temperature:g}")
    style = styles()
    longest = 1
    for vals, names in curves.items():
        longest = max(longest, len(vals))
        ax.plot(range(1, len(vals) + 1), vals, label=" = ".join(names), **next(style))
    ax.set_xticks(range(1, longest + 1))  # draft positions are whole numbers
    ax.set(xlabel="draft position j", ylabel="P(position j accepted | drafted)", ylim=(0, 1.05),
           title="Per-position acceptance")
    ax.legend(fontsize=6)
    return save(fig, out, "per_position_acceptance")


def plot_time_split(df, out: Path) -> Path | None:
    d = _ok(df, "verify_fraction")
    if d.empty:
        return None
    d = d.sort_values(["workload", "method", "batch_size"])
    multi = _multi(d)
    labels = [f"{_who(r, multi)}\n{r.workload}\nb{r.batch_size}" for _, r in d.iterrows()]
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(d)), 4))
    x = range(len(d))
    ax.bar(x, d.draft_fraction, label="draft", color="tab:orange")
    ax.bar(x, d.verify_fraction, bottom=d.draft_fraction, label="verify", color="tab:blue")
    ax.bar(x, d.other_fraction, bottom=d.draft_fraction + d.verify_fraction, label="other", color="tab:grey")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=6)
    ax.set(ylabel="share of decode cycle time", ylim=(0, 1), title="Where a draft/verify cycle spends its time")
    ax.legend(fontsize=7)
    return save(fig, out, "time_split")


def plot_predicted_vs_measured(df, out: Path) -> Path | None:
    d = _ok(df, "predicted_speedup", "speedup")
    if d.empty:
        return None
    fig, ax = plt.subplots(figsize=(5, 4.5))
    for m, g in d.groupby(["backend", "method"] if _multi(d) else ["method"]):
        ax.scatter(g.predicted_speedup, g.speedup, label="/".join(m) if isinstance(m, tuple) else m)
    lim = [0, max(1.5, float(max(d.predicted_speedup.max(), d.speedup.max())) * 1.1)]
    ax.plot(lim, lim, color="grey", ls="--", lw=0.8)
    ax.set(xlim=lim, ylim=lim, xlabel="predicted (1-a^(k+1))/(1-a) / (k c + r)", ylabel="measured speedup",
           title="Predicted vs measured speedup")
    ax.legend(fontsize=7)
    return save(fig, out, "predicted_vs_measured")


def plot_acceptance_vs_temperature(df, out: Path) -> Path | None:
    d = _ok(df, "acceptance_rate")
    if d.empty or d.temperature.nunique() < 2:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for (m, w), g in d.groupby(["method", "workload"]):
        g = g.groupby("temperature").acceptance_rate.mean().sort_index()
        ax.plot(g.index, g.values, marker="o", label=f"{m}/{w}")
    ax.set(xlabel="temperature", ylabel="acceptance rate (alpha)", ylim=(0, 1.05), title="Acceptance vs temperature")
    ax.legend(fontsize=7)
    return save(fig, out, "acceptance_vs_temperature")


def _load_rows(df) -> pd.DataFrame:
    d = _ok(df)
    if d.empty:
        return d
    d = d[_loaded(d) & speculative_rows(d)].copy()
    for col in ("load_level", "tpot_speedup", "tpot_speedup_low", "tpot_speedup_high", "tpot_p50", "baseline_tpot_p50",
                "output_tokens_per_s", "baseline_output_tokens_per_s", "goodput_ratio"):
        if col in d.columns:
            d[col] = pd.to_numeric(d[col], errors="coerce")
    return d


def plot_speedup_vs_load(df, out: Path) -> Path | None:
    """TPOT speedup (baseline p50 TPOT / spec p50 TPOT) against the load level, one curve per
    engine and method, one panel per load kind and workload; the bars span the repeats' ratios."""
    d = _load_rows(df)
    if d.empty:
        return None
    panels = sorted({(k, w) for k, w in zip(d.load_kind, d.workload)})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False, sharey=True)
    for ax, (kind, w) in zip(axes[0], panels):
        style = styles()
        for (b, m), g in d[(d.load_kind == kind) & (d.workload == w)].groupby(["backend", "method"]):
            g = g.sort_values("load_level")
            # the pooled ratio need not lie inside the repeats' own range: bars clipped at the point
            err = [(g.tpot_speedup - g.tpot_speedup_low).clip(lower=0), (g.tpot_speedup_high - g.tpot_speedup).clip(lower=0)]
            ax.errorbar(g.load_level, g.tpot_speedup, yerr=err, capsize=3, label=f"{b}/{m}", **next(style))
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        levels = sorted(d[(d.load_kind == kind) & (d.workload == w)].load_level.unique())
        ax.set(title=f"{w}, load={kind}", xlabel="requests in flight" if kind == "concurrency" else "requests/s")
        if kind == "concurrency" and len(levels) > 1 and min(levels) > 0:  # 1 2 4 8 ...: a log axis, labelled
            ax.set(xscale="log", xticks=levels)
            ax.set_xticklabels([f"{x:g}" for x in levels])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0][0].set_ylabel("p50 TPOT, SD off / SD on")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Speculation under load: where it stops paying (TPOT speedup > 1)")
    return save(fig, out, "speedup_vs_load")


def plot_latency_vs_throughput(df, out: Path) -> Path | None:
    """p50 TPOT against output tokens/s at each load point, SD on (solid) and SD off (dashed)."""
    d = _load_rows(df)
    if d.empty:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for (b, m, kind, w), g in d.groupby(["backend", "method", "load_kind", "workload"]):
        g = g.sort_values("load_level")
        line = ax.plot(g.output_tokens_per_s, g.tpot_p50 * 1e3, marker="o", label=f"{b}/{m} {w} ({kind}) SD on")[0]
        ax.plot(g.baseline_output_tokens_per_s, g.baseline_tpot_p50 * 1e3, marker="x", ls="--", color=line.get_color(),
                label=f"{b}/{m} {w} ({kind}) SD off")
    ax.set(xlabel="output tokens/s (whole load run)", ylabel="p50 TPOT (ms)", title="Latency against throughput")
    ax.legend(fontsize=6)
    return save(fig, out, "latency_vs_throughput")


def _crossover_verdict(r, metric: str) -> str:
    """One crossover row (bench.load.crossover) in words: up to which level SD pays by `metric`."""
    unit = "concurrency" if r.load_kind == "concurrency" else "rate"
    if r.pays_up_to != r.pays_up_to:
        verdict = f"off at every {unit} measured ({r.levels})"
    elif r.stops_paying_at != r.stops_paying_at:
        verdict = f"on: pays at every {unit} measured, up to {r.pays_up_to:g}"
    else:
        verdict = f"on up to {unit} {r.pays_up_to:g}, off from {r.stops_paying_at:g}"
    return (verdict + ("" if r.clean else " (the curve crosses 1 more than once: noisy, rerun with more repeats)")
            + f"; {metric} {r[metric]} at {r.levels}"
            + (f"; at {', '.join(f'{x:g}' for x in r.straddles)} the repeats' range holds 1 (not counted as paying)"
               if r.straddles else "")
            + (f"; at {', '.join(f'{x:g}' for x in r.uncertain)} every repeat paid but the 95% interval "
               "holds 1 (more requests a level would settle it)" if r.uncertain else ""))


def load_markdown(df: pd.DataFrame) -> list[str]:
    """The load points' table and the crossover: per engine, method and workload the highest
    level at which SD still improved p50 TPOT."""
    from .load import crossover

    d = _load_rows(df)
    if d.empty:
        return []
    cols = ["backend", "method", "workload", "load_label", "tpot_speedup", "tpot_speedup_low", "tpot_speedup_high",
            "tpot_speedup_ci_low", "tpot_speedup_ci_high", "speedup", "goodput_rps", "baseline_goodput_rps", "tpot_p50", "baseline_tpot_p50", "ttft_p50",
            "baseline_ttft_p50", "mean_running_batch", "mean_in_flight", "acceptance_rate"]
    lines = ["## Under load", "",
             "Each load point served the same requests with the same arrivals with SD on and off, interleaved. "
             "tpot_speedup = baseline p50 TPOT / SD p50 TPOT (low/high: the repeats' own ratios; ci: its 95% interval over "
             "requests, a paired bootstrap); speedup = output "
             "throughput ratio; goodput = requests/s within the SLOs (docs/metrics.md).", "",
             markdown_table(d.sort_values(["backend", "method", "workload", "load_kind", "load_level"]), cols), "",
             "### Where speculation stops paying", ""]
    by_goodput = {tuple(r[k] for k in ("backend", "method", "workload", "load_kind")): r
                  for _, r in crossover(d, "goodput_ratio").iterrows()} if "goodput_ratio" in d else {}
    for _, r in crossover(d).iterrows():
        lines.append(f"- {r.backend}/{r.method} on {r.workload}: by TPOT, {_crossover_verdict(r, 'tpot_speedup')}")
        g = by_goodput.get((r.backend, r.method, r.workload, r.load_kind))
        if g is not None:  # goodput counts requests within the SLOs: it can stop paying at another level
            lines.append(f"  - by goodput (requests/s within the SLOs), {_crossover_verdict(g, 'goodput_ratio')}")
    return lines + [""]


PLOTS = (plot_speedup_vs_load, plot_latency_vs_throughput, plot_speedup_vs_batch, plot_per_position, plot_time_split,
         plot_predicted_vs_measured, plot_acceptance_vs_temperature, *lengths_report.PLOTS)


def write_report(sweep_dir: Path, out: Path | None = None) -> Path:
    sweep_dir = Path(sweep_dir)
    out = Path(out) if out else sweep_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    df = load_summaries(sweep_dir)
    if df.empty:
        raise FileNotFoundError(f"{sweep_dir}: no job results (*/summary.json) found")
    # a column no row wrote (rows imported from another tool's file hold no cycle trace) is empty, not missing
    df = df.assign(**{c: None for c in JobSummary.names() if c not in df.columns})
    controls = _controls(df)
    df = df[~_is_control(df)]  # every table and plot below is of the methods; the controls get their own section
    made = [p for p in (f(df, out) for f in PLOTS) if p is not None] if len(df) else []
    d = df.sort_values([c for c in ("workload", "batch_size", "method") if c in df.columns])
    env = next((e for e in df.get("env", []) if isinstance(e, dict)), {})
    lines = [f"# specsweep report: {sweep_dir.name}", "",
             f"{len(df)} jobs: " + ", ".join(f"{n} {s}" for s, n in df.status.value_counts().items()), "",
             f"Machine: {env.get('cpu', '?')}, {env.get('cpu_count', '?')} CPUs; load average at start of first job "
             f"{env.get('loadavg', '?')}; commit {env.get('git_commit', '?')}.", "",
             "Speedup is throughput with speculation over throughput of the same engine without it, on the same "
             "requests and batches (paired: batch by batch, interleaved; 95% cluster-bootstrap interval over the "
             "pairs). Every metric's definition, and which engine field it comes from: docs/metrics.md.", "",
             markdown_table(d, REPORT_COLUMNS), ""]
    imported = df[df.imported_from.notna()] if "imported_from" in df else df.iloc[:0]
    if len(imported):  # another tool measured these: say so before any figure of theirs is read as paired
        lines += [f"{len(imported)} of these jobs were read from other tools' result files by specsweep-import "
                  "(`imported_from` names each tool and file): their arms were measured by that tool, one run each, "
                  "not paired and interleaved, so they carry no interval; what a file did not hold is empty.", ""]
    lines += controls_markdown(controls)
    lines += load_markdown(df)
    lines += lengths_report.lengths_markdown(df)
    lines += per_request_markdown(df)
    lines += speculation_profile.by_category_markdown(sweep_dir, df)
    lines += flags_markdown(df)
    errs = df[df.status != "ok"]
    if len(errs):
        lines += ["## Jobs that did not complete, or lost requests", ""] + [f"- `{r.job}`: {r.status}: {r.error}" for _, r in errs.iterrows()] + [""]
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in made] + [""]
    from .decision import decide, engine_classes, markdown as decision_markdown, method_configs

    choices, notes = decide(df, sweep_dir)  # the report ends with what to run, in each engine's own syntax
    choices.to_csv(out / "tuned_configs.csv", index=False)
    lines += [decision_markdown(choices, notes, engine_classes(df, sweep_dir), method_configs(df, sweep_dir))]
    text = "\n".join(lines)
    (out / "summary.md").write_text(text)
    (out / "index.json").write_text(json.dumps([p.name for p in made]))
    write_html(out, f"specsweep report: {sweep_dir.name}", text, pd.concat([df, controls]))
    return out


def _is_control(df: pd.DataFrame) -> pd.Series:
    return df.aa_control.fillna(False).astype(bool) if "aa_control" in df.columns else pd.Series(False, index=df.index)


def _controls(df: pd.DataFrame) -> pd.DataFrame:
    return df[_is_control(df)]


AA_COLUMNS = ("backend", "workload", "batch_size", "load_label", "status", "speedup", "speedup_ci_low", "speedup_ci_high",
              "speedup_baseline_first", "speedup_method_first", "pairs_baseline_first", "pairs_method_first",
              "tpot_speedup", "tpot_speedup_ci_low", "tpot_speedup_ci_high", "goodput_ratio", "goodput_ratio_ci_low",
              "goodput_ratio_ci_high", "aa_verdict")


def controls_markdown(controls: pd.DataFrame) -> list[str]:
    """The A/A controls (aa_control=true: both arms the same engine without speculation): each
    must read 1.0 within its intervals; one that does not is flagged, since every ratio of the
    same engine and load measured beside it rests on the same harness."""
    if controls.empty:
        return []
    cols = [c for c in AA_COLUMNS if c in controls.columns]
    lines = ["## Controls (A/A)", "",
             "Both arms are the same engine without speculation, measured as any method is: every ratio must read "
             "1.0 within its interval (docs/metrics.md, \"The A/A control\"). Per-order columns: the pairs whose "
             "baseline, or whose method arm, ran first.", "",
             markdown_table(controls.sort_values([c for c in ("backend", "batch_size", "load_label") if c in cols]), cols), ""]
    for _, r in controls.iterrows():
        verdict = r.get("aa_verdict")
        if r.get("status") == "ok" and isinstance(verdict, str) and verdict.startswith("excludes"):
            lines.append(f"- **Flag** `{r.job}`: the A/A control {verdict}: ratios measured beside it on this engine "
                         "and load carry that bias.")
    return lines + [""]


def per_request_markdown(df: pd.DataFrame) -> list[str]:
    """The spread of acceptance over a job's requests beside its overall alpha. The overall figure
    weighs each request by its drafts, so long completions count most; the percentiles say whether
    every request accepts alike or a few carry the job."""
    if "request_acceptance_p50" not in df.columns:
        return []
    d = df[pd.to_numeric(df.request_acceptance_p50, errors="coerce").notna()]
    if d.empty:
        return []
    d = d.sort_values([c for c in ("backend", "method", "workload", "batch_size") if c in d.columns])
    cols = ["backend", "method", "workload", "batch_size", "acceptance_rate", "request_acceptance_p10",
            "request_acceptance_p50", "request_acceptance_p90", "request_acceptance_mean"]
    return ["## Acceptance per request", "",
            "acceptance_rate is the job's accepted over drafted tokens, every request's drafts summed: long "
            "completions weigh most. The percentiles are over the requests' own rates (each request's accepted "
            "over its drafted tokens): a wide p10-p90 says a few requests carry the "
            "job's figure.", "", markdown_table(d, cols), ""]


def flags_markdown(df: pd.DataFrame) -> list[str]:
    """Rows whose numbers deserve doubt, and why."""
    out = []
    for _, r in df[df.status == "ok"].iterrows() if "status" in df.columns else []:
        share, drift = r.get("baseline_roofline_share"), r.get("baseline_drift")
        if isinstance(share, float) and share == share and share < SLOW_BASELINE:
            bound = r.get("roofline_bound")
            which = f"{bound}-bound " if isinstance(bound, str) else ""
            spread = r.get("read_bandwidth_spread")
            moved = (f"; the machine's bandwidth probes spread {100 * spread:.0f}% over the job"
                     if isinstance(spread, float) and spread > PROBE_SPREAD else "")
            out.append(f"- `{r.job}`: the baseline runs at {100 * share:.0f}% of its {which}roofline "
                       f"({r.get('baseline_step_ms'):.1f} ms a step against {r.get('roofline_step_ms'):.1f} ms{moved}): "
                       "its speedup may come from a slow baseline rather than from the method.")
        if isinstance(drift, float) and drift == drift and abs(drift) > DRIFT_LIMIT:
            out.append(f"- `{r.job}`: the shared baseline drifted {100 * drift:+.0f}% (its first batch measured again "
                       "in this job): the machine's load moved; rerun with baseline=paired.")
    if "per_position_basis" in df.columns and df.per_position_basis.dropna().nunique() > 1:
        groups = df.dropna(subset=["per_position_basis"]).groupby("per_position_basis")
        out.append("- Per-position curves of different bases are not comparable: "
                   + "; ".join(f"{basis}: {', '.join(sorted(set(g.backend + '/' + g.method)))}" for basis, g in groups))
    return (["## Flags", ""] + out + [""]) if out else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specsweep-report", description="Plots and a markdown summary of sweep results.")
    ap.add_argument("results_dir", help="a sweep folder (results/<sweep_name>) or a results root holding sweeps")
    ap.add_argument("--out", help="output folder (default: <sweep>/report)")
    a = ap.parse_args(argv)
    sweeps = find_sweep_dirs(Path(a.results_dir))
    if not sweeps:
        print(f"specsweep-report: no sweep results under {a.results_dir!r} (expected <dir>/<job>/summary.json)", file=sys.stderr)
        return 2
    for s in sweeps:
        out = write_report(s, Path(a.out) / s.name if a.out and len(sweeps) > 1 else a.out)
        print(f"{s}: report in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
