"""`specsweep-gate RESULTS_DIR --baseline results/baselines/NAME.json`: compare a sweep with a
recorded baseline and exit non-zero on a regression (a CI gate, as vLLM's spec-decode checks).

Rules, per job present in both:
- acceptance metrics (acceptance_rate, mean_acceptance_length, each per-position rate) may not
  fall by more than a relative tolerance (default 5%; `--tolerance metric=value` per metric).
  Greedy acceptance is nearly deterministic, so this is tight. A rise beyond it is reported as
  `improved` (record it with --update) and does not fail.
- speedup and throughput are noisy: a regression only when even the optimistic end of this run's
  95% interval is below the recorded value by more than a ratio (`--speedup-tolerance`, default
  0.15; `--throughput-tolerance`, default 0.5, since absolute throughput follows the machine).
- lossless `false` fails whatever the baseline says (`n/a`, sampled runs, passes); a job with
  status error fails, also one the baseline does not have; a job of the baseline missing from the
  run fails (unless --allow-missing); a job new in the run is listed.
Jobs are matched by their whole identity (bench.results.JobKey: every setting, plus a digest of
the backend, model, method and workload configs).
Exit status: 0 pass, 1 regression or failed job, 2 bad usage or a missing, malformed or
mismatched baseline.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from dataclasses import asdict, fields

from .results import FAILED_STATUSES, JobKey, find_sweep_dirs, load_summaries, write_json
from .summary import GATE_NUMERIC as NUMERIC, GATE_RECORDED as RECORDED

FORMAT = "specsweep-gate-baseline"
VERSION = 2  # 2: jobs keyed by the whole JobKey (version 1 left out seed, top_p, top_k, lengths)
ACCEPTANCE_METRICS = ("acceptance_rate", "mean_acceptance_length")
# What a job of the baseline and one of the run may share and still be told apart by the rest of
# the key: matching on these, the gate names the setting that differs instead of "missing".
COARSE = ("backend", "model", "method", "workload", "batch_size", "temperature", "num_speculative_tokens")


class GateError(ValueError):
    """A malformed or mismatched baseline, or bad usage: exit status 2."""


def job_key(row) -> str:
    try:
        return JobKey.from_row(row).label()
    except (ValueError, TypeError) as e:
        raise GateError(f"job {row.get('job', '?')}: {e}") from None


def _num(v):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def check_rows(df, sweep: Path) -> None:
    """Every value the gate reads, of the type it must have: else a GateError naming the summary
    file and the key (exit 2), never a traceback read as a regression."""
    for _, r in df.iterrows():
        where = sweep / str(r.get("job_dir")) / "summary.json"
        for k in NUMERIC:
            v = r.get(k)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)):
                raise GateError(f"{where}: {k} = {v!r} is not a number")
        pos = r.get("per_position_acceptance")
        if pos is not None and not (isinstance(pos, float) and math.isnan(pos)) and not (
                isinstance(pos, list) and all(x is None or isinstance(x, (int, float)) for x in pos)):
            raise GateError(f"{where}: per_position_acceptance = {pos!r} is not a list of numbers")
        if r.get("lossless") not in (None, "true", "false", "n/a") and not (isinstance(r.get("lossless"), float)):
            raise GateError(f"{where}: lossless = {r.get('lossless')!r}; expected true, false or n/a")
        job_key(r)  # identity fields present and of the right type


def record(df) -> dict:
    jobs = {}
    for _, r in df.iterrows():
        if r.get("status") != "ok":
            continue
        jobs[job_key(r)] = {"identity": asdict(JobKey.from_row(r)),
                            "metrics": {k: (list(r[k]) if k == "per_position_acceptance" and isinstance(r.get(k), list) else _num(r.get(k)))
                                        for k in RECORDED}}
    return {"format": FORMAT, "version": VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "jobs": jobs}


def load_baseline(path: Path) -> dict:
    if not path.exists():
        raise GateError(f"baseline {path} does not exist; record one with: specsweep-gate RESULTS_DIR --baseline {path} --update")
    try:
        b = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise GateError(f"baseline {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(b, dict) or b.get("format") != FORMAT:
        raise GateError(f"baseline {path} is not a specsweep gate baseline (expected \"format\": \"{FORMAT}\")")
    if b.get("version") != VERSION:
        raise GateError(f"baseline {path} has version {b.get('version')!r}; this specsweep reads version {VERSION} "
                        f"(record it again: specsweep-gate RESULTS_DIR --baseline {path} --update)")
    if not isinstance(b.get("jobs"), dict) or not all(isinstance(j, dict) and "metrics" in j and "identity" in j for j in b["jobs"].values()):
        raise GateError(f"baseline {path}: \"jobs\" must map job keys to {{\"identity\": ..., \"metrics\": ...}}")
    for key, j in b["jobs"].items():
        if not isinstance(j["identity"], dict) or not isinstance(j["metrics"], dict):
            raise GateError(f"baseline {path}: job {key!r}: \"identity\" and \"metrics\" must be objects")
        for name, v in j["metrics"].items():
            bad = (name == "per_position_acceptance" and not (v is None or isinstance(v, list) and all(
                   x is None or isinstance(x, (int, float)) for x in v))) or (
                   name not in ("status", "lossless", "per_position_acceptance") and v is not None
                   and not isinstance(v, (int, float)))
            if bad:
                raise GateError(f"baseline {path}: job {key!r}: metrics.{name} = {v!r} is not a number")
    return b


def _rel(now, base):
    if now is None or base is None:
        return None
    return (now - base) / base if base else (0.0 if now == base else math.inf)


def compare(df, baseline: dict, tolerances: dict, speedup_tol: float, throughput_tol: float, allow_missing: bool,
            speed: bool = True):
    """Returns (rows of (job, metric, baseline, now, change, verdict), failed). speed=False: the
    acceptance-only gate (status, losslessness and acceptance; speedup and throughput not compared,
    for a run on another machine than the baseline's)."""
    now = {job_key(r): r for _, r in df.iterrows()}
    common = set(now) & set(baseline["jobs"])
    if baseline["jobs"] and not common:
        _explain_mismatch(now, baseline)
        raise GateError("the run and the baseline have no job in common; baseline jobs: "
                        + ", ".join(sorted(baseline["jobs"])[:6]) + "; run jobs: " + ", ".join(sorted(now)[:6]))
    rows = []
    for key in sorted(baseline["jobs"]):
        if key not in now:
            rows.append((key, "job", "recorded", "missing", "", "missing" if allow_missing else "FAIL"))
            continue
        r = now[key]
        if r.get("status") != "ok":
            rows.append((key, "status", "ok", r.get("status"), str(r.get("error"))[:80], "FAIL"))
            continue
        m = baseline["jobs"][key]["metrics"]
        rows += _acceptance_checks(key, m, r, tolerances)
        if speed:
            rows += _speed_checks(key, m, r, speedup_tol, throughput_tol)
    for key in sorted(set(now) - set(baseline["jobs"])):
        r = now[key]
        if r.get("status") in FAILED_STATUSES:  # a failed job fails the gate, recorded or not
            rows.append((key, "status", "-", r.get("status"), str(r.get("error"))[:80], "FAIL"))
        else:
            rows.append((key, "job", "-", r.get("status"), "", "new"))
    return rows, any(row[-1] == "FAIL" for row in rows)


def _acceptance_checks(key: str, m: dict, r, tolerances: dict) -> list[tuple]:
    """Losslessness (a recorded true must stay true), then every acceptance metric and position
    against the record: FAIL below it by more than its tolerance, improved above."""
    lossless_ok = r.get("lossless") in ("true", "n/a") and not (m.get("lossless") == "true" and r.get("lossless") != "true")
    rows = [(key, "lossless", m.get("lossless"), r.get("lossless"), "", "ok" if lossless_ok else "FAIL")]
    checks = [(k, m.get(k), _num(r.get(k))) for k in ACCEPTANCE_METRICS]
    for j, (b_j, n_j) in enumerate(zip(m.get("per_position_acceptance") or [], list(r.get("per_position_acceptance") or []))):
        checks.append((f"per_position_acceptance[{j + 1}]", _num(b_j), _num(n_j)))
    for name, b_v, n_v in checks:
        if b_v is None:
            continue
        tol = tolerances.get(name.split("[")[0], tolerances.get("acceptance", 0.05))
        ch = _rel(n_v, b_v)
        rows.append((key, name, b_v, n_v, ch, "FAIL" if ch is None or ch < -tol else ("improved" if ch > tol else "ok")))
    return rows


def _speed_checks(key: str, m: dict, r, speedup_tol: float, throughput_tol: float) -> list[tuple]:
    """Noise-aware: fail only if this run's optimistic end (its interval's top) is clearly below
    the record; throughput widened by the same factor."""
    rows = []
    sp_b, sp_n, sp_hi = m.get("speedup"), _num(r.get("speedup")), _num(r.get("speedup_ci_high"))
    if sp_b is not None and sp_n is not None:
        hi = sp_hi if sp_hi is not None else sp_n
        rows.append((key, "speedup", sp_b, sp_n, _rel(sp_n, sp_b), "FAIL" if hi < sp_b * (1 - speedup_tol) else "ok"))
    tp_b, tp_n = m.get("tokens_per_s"), _num(r.get("tokens_per_s"))
    if tp_b is not None and tp_n is not None:
        widen = (sp_hi / sp_n) if sp_hi and sp_n else 1.0
        rows.append((key, "tokens_per_s", tp_b, tp_n, _rel(tp_n, tp_b),
                     "FAIL" if tp_n * widen < tp_b * (1 - throughput_tol) else "ok"))
    return rows


def _explain_mismatch(now: dict, baseline: dict) -> None:
    """A run whose jobs match the baseline's but for a setting: a GateError naming it."""
    for key, base in sorted(baseline["jobs"].items()):
        ident = base["identity"]
        for r in now.values():
            if all(str(ident.get(f)) == str(r.get(f)) if f != "temperature" else float(ident[f]) == float(r[f])
                   for f in COARSE):
                run_ident = asdict(JobKey.from_row(r))
                diff = [f.name for f in fields(JobKey) if f.name not in COARSE and ident.get(f.name) != run_ident[f.name]]
                if diff:
                    what = ", ".join(f"{f}={ident.get(f)}" for f in diff)
                    has = ", ".join(f"{f}={run_ident[f]}" for f in diff)
                    raise GateError(f"job {key}: the baseline was recorded with {what}, this run has {has}; rerun with "
                                    "the baseline's settings or record a new baseline (--update)")


def markdown(rows, failed: bool) -> str:
    def f(v):
        if isinstance(v, float):
            return "-" if math.isnan(v) else f"{v:.4g}"
        return "-" if v is None else str(v)

    def ch(v):
        return f"{100 * v:+.1f}%" if isinstance(v, float) and not math.isinf(v) else f(v) if v != "" else ""

    lines = [f"## specsweep gate: {'FAIL' if failed else 'pass'}", "", "| job | metric | baseline | now | change | verdict |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {k} | {m} | {f(b)} | {f(n)} | {ch(c)} | {v} |" for k, m, b, n, c, v in rows]
    return "\n".join(lines) + "\n"


def _tolerances(items) -> dict:
    out = {}
    for it in items or []:
        name, _, value = it.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise GateError(f"--tolerance {it!r}: expected METRIC=FRACTION, e.g. acceptance_rate=0.05") from None
        valid = ("acceptance", *ACCEPTANCE_METRICS, "per_position_acceptance")
        if name not in valid:
            raise GateError(f"--tolerance {it!r}: unknown metric {name!r}; valid: {', '.join(valid)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specsweep-gate", description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir", help="a sweep folder (results/<sweep_name>)")
    ap.add_argument("--baseline", required=True, help="baseline JSON (results/baselines/NAME.json)")
    ap.add_argument("--update", action="store_true", help="record this run as the new baseline and exit")
    ap.add_argument("--tolerance", action="append", metavar="METRIC=FRACTION",
                    help="relative tolerance for an acceptance metric (default 0.05 for each)")
    ap.add_argument("--speedup-tolerance", type=float, default=0.15)
    ap.add_argument("--throughput-tolerance", type=float, default=0.5)
    ap.add_argument("--allow-missing", action="store_true", help="a baseline job absent from the run does not fail")
    ap.add_argument("--only", choices=["acceptance"], help="acceptance: compare job status, losslessness and "
                    "acceptance only, not speedup or throughput (a run on another machine than the baseline's)")
    ap.add_argument("--allow-failed", action="store_true",
                    help="with --update: record the jobs that succeeded even though others failed")
    ap.add_argument("--summary", help="also write the markdown table here (e.g. $GITHUB_STEP_SUMMARY)")
    a = ap.parse_args(argv)
    try:
        sweeps = find_sweep_dirs(Path(a.results_dir))
        if len(sweeps) != 1:
            raise GateError(f"{a.results_dir}: expected one sweep folder with job results, found {len(sweeps)}")
        try:
            df = load_summaries(sweeps[0], strict=True)
        except ValueError as e:
            raise GateError(str(e)) from None
        check_rows(df, sweeps[0])
        path = Path(a.baseline)
        if a.update:
            failed = df[df.status.isin(FAILED_STATUSES)]
            if len(failed) and not a.allow_failed:
                print(f"specsweep-gate: not recorded: {len(failed)} of {len(df)} jobs failed ("
                      + ", ".join(failed.job_dir.astype(str)) + "); fix them, or pass --allow-failed to record the "
                      "others", file=sys.stderr)
                return 1
            b = record(df)
            if not b["jobs"]:
                raise GateError(f"{a.results_dir}: no job with status ok to record")
            write_json(path, b)
            print(f"recorded {len(b['jobs'])} jobs as the baseline {path}")
            left = df[df.status != "ok"]
            if len(left):
                print(f"left out {len(left)} jobs that did not succeed: "
                      + ", ".join(f"{j} ({s})" for j, s in zip(left.job_dir, left.status)))
            return 0
        rows, failed = compare(df, load_baseline(path), _tolerances(a.tolerance), a.speedup_tolerance,
                               a.throughput_tolerance, a.allow_missing, speed=a.only != "acceptance")
    except GateError as e:
        print(f"specsweep-gate: {e}", file=sys.stderr)
        return 2
    md = markdown(rows, failed) + ("\nAcceptance only (--only acceptance): speedup and throughput were not compared.\n"
                                   if a.only == "acceptance" else "")
    print(md)
    if a.summary:
        with open(a.summary, "a") as f:
            f.write(md)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
