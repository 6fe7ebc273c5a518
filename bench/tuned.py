"""Tuned engine configs: the end of the decision report. Per engine, workload and temperature, and
per batch size (static batches) or load level (load points), the method and draft length k to
run, or off, written in the engine's own syntax by its adapter (Backend.engine_config: vLLM's
--speculative-config JSON, SGLang's server arguments, llama-server's flags, specsweep's overrides
for the engines whose loop is specsweep's), with the speedup it rests on.

- Rows whose acceptance was forced (method=synthetic: an engine's cost surface, not a config to
  run) are left out.
- Measured rows decide: the fastest (method, k) at that batch size whose 95% interval lies above
  1, else off. At a load point: the fastest by tpot_speedup whose repeats all improved p50 TPOT
  (tpot_speedup_low > 1), else off.
- The simulator fills in what was not measured, and says so: where the sweep folder has a cost
  model fitted on its own cycles (specsweep-fit-cost SWEEP: SWEEP/cost_model.yaml) and a job of
  the workload has traces (specsweep-trace JOB: JOB/traces.jsonl), specsweep-oracle's fixed:M:K
  (set batches, k = 1 .. the traces' k) is simulated at every static batch size of the engine
  whose cycles the cost model was fitted on. A batch size without a measured row takes the
  simulator's choice (marked simulated); where rows exist, a (method, k) left unmeasured that the
  simulator ranks above the measured choice is noted, for the next sweep to measure. The
  simulator models static greedy batches only: load points and T > 0 rows are measured only.
"""
from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pandas as pd

from .methods import method_defaults, speculative_rows

SIM_MARGIN = 0.02  # a simulated alternative is noted when it beats the choice's simulation by more than this


def _f(v, fmt="{:.2f}"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _job_config(sweep_dir: Path, job: str) -> dict | None:
    from omegaconf import OmegaConf

    f = Path(sweep_dir) / job / "config.yaml"
    return OmegaConf.to_container(OmegaConf.load(f)) if f.exists() else None


def engine_classes(df: pd.DataFrame, sweep_dir: Path) -> dict:
    """backend name -> its adapter class, from a job's config (backend._target_, as the runner
    builds it), or the error that stopped it (an adapter that cannot be imported here)."""
    from hydra.utils import get_class

    out = {}
    for be, g in df.groupby("backend"):
        for job in g.job:
            cfg = _job_config(sweep_dir, job)
            if cfg and cfg.get("backend", {}).get("_target_"):
                try:
                    out[be] = get_class(cfg["backend"]["_target_"])
                except Exception as e:  # noqa: BLE001 - an adapter module that fails to import here
                    out[be] = f"its adapter {cfg['backend']['_target_']} cannot be imported here ({e})"
                break
    return out


def method_configs(df: pd.DataFrame, sweep_dir: Path) -> dict:
    """(backend, method) -> the method config a job of the sweep ran it with."""
    out = {}
    for _, r in df.iterrows():
        key = (r.backend, r.method)
        if key not in out:
            cfg = _job_config(sweep_dir, r.job)
            if cfg:
                out[key] = cfg["method"]
    return out


def simulate_missing(df: pd.DataFrame, sweep_dir: Path) -> tuple[pd.DataFrame, list[str]]:
    """fixed:M:K simulated from the sweep's traces under its fitted cost model: rows (backend,
    workload, batch_size, method, k, speedup, traces), and notes on what was not simulated and why."""
    from .costmodel import load_cost_model
    from .oracle.policies import FixedK
    from .oracle.simulate import simulate_set
    from .oracle.tracefile import load_traces

    cols = ["backend", "workload", "batch_size", "method", "k", "speedup", "traces"]
    sweep_dir = Path(sweep_dir)
    cost_file = sweep_dir / "cost_model.yaml"
    traced = [(r, sweep_dir / r.job / "traces.jsonl") for _, r in df.iterrows()
              if (sweep_dir / r.job / "traces.jsonl").exists()]
    if not traced:
        return pd.DataFrame(columns=cols), []
    if not cost_file.exists():
        return pd.DataFrame(columns=cols), [f"traces found, but no cost model: run `specsweep-fit-cost {sweep_dir}` to let "
                                            "the simulator fill in what was not measured"]
    fitted = sorted({r.backend for _, r in df.iterrows() if (sweep_dir / r.job / "cycles.parquet").exists()})
    if len(fitted) != 1:
        return pd.DataFrame(columns=cols), [f"the cost model is fitted on the cycles of {fitted or 'no engine'}: the "
                                            "simulator is used only where they are one engine's"]
    be = fitted[0]
    cost = load_cost_model(str(cost_file))
    static = df[(df.backend == be) & ~_loaded(df)]
    sizes = sorted({int(b) for b in static.batch_size})
    rows, notes, seen = [], [], set()
    for r, f in traced:
        if r.workload in seen:
            continue
        seen.add(r.workload)
        traces = load_traces(f)
        meta = f.with_suffix(".meta.json")
        k_traced = json.loads(meta.read_text()).get("k") if meta.exists() else None
        if not k_traced:
            notes.append(f"{f}: no {meta.name} giving the draft length it was traced at: not simulated")
            continue
        fits = [b for b in sizes if b <= len(traces)]
        if len(fits) < len(sizes):
            notes.append(f"{r.workload}: {len(traces)} traced requests cannot fill batches of "
                         f"{[b for b in sizes if b > len(traces)]}: those are not simulated")
        for m in sorted({m for t in traces for m in t.acc}):
            for k in range(1, int(k_traced) + 1):
                sim = simulate_set(traces, FixedK((m,), k), cost, fits, "faithful", len(traces))
                rows += [{"backend": be, "workload": r.workload, "batch_size": b, "method": m, "k": k, "speedup": s,
                          "traces": f"{f.parent.name}/{f.name}"} for b, s in zip(sim["batch_sizes"], sim["speedup"])]
    return pd.DataFrame(rows, columns=cols), notes


def _loaded(df) -> pd.Series:
    return df.load_kind.fillna("static") != "static" if "load_kind" in df.columns else pd.Series(False, index=df.index)


def _num(d: pd.DataFrame, cols) -> pd.DataFrame:
    d = d.copy()
    for c in cols:
        d[c] = pd.to_numeric(d[c], errors="coerce") if c in d.columns else math.nan
    return d


def tuned_configs(df: pd.DataFrame, sweep_dir: Path) -> tuple[pd.DataFrame, list[str]]:
    """One row per (backend, workload, temperature, level): use (method k=K or off), config (the
    engine's own syntax), basis (measured | simulated), speedup, low, high, rests_on, note."""
    cols = ["backend", "workload", "temperature", "level", "use", "method", "k", "config", "basis", "speedup", "low",
            "high", "rests_on", "note"]
    if df.empty or "status" not in df.columns:
        return pd.DataFrame(columns=cols), []
    d = df[(df.status == "ok") & speculative_rows(df)]
    if "acceptance_forced" in d.columns:  # a synthetic method measures the engine, not a config to run
        d = d[d.acceptance_forced.fillna(False) != True]  # noqa: E712 - a column of bools and NaN
    if "backend" not in d.columns or d.empty:
        return pd.DataFrame(columns=cols), []
    d = _num(d, ["speedup", "speedup_ci_low", "speedup_ci_high", "tpot_speedup", "tpot_speedup_low", "tpot_speedup_high"])
    classes = engine_classes(d, sweep_dir)
    mcfg = method_configs(d, sweep_dir)
    sims, notes = simulate_missing(d, sweep_dir)
    rows = []

    def config(be, method, k):
        cls = classes.get(be)
        if cls is None or isinstance(cls, str):
            return f"n/a: {cls or 'no job config names its adapter'}"
        cfg = (mcfg.get((be, method)) or {**method_defaults(method), "name": method}) if method else {}
        try:
            argv = cls.engine_config(cfg, k)
        except ValueError as e:
            return f"n/a on this engine: {e}"
        if argv is None:
            return "n/a: the adapter does not say (the engine is configured outside specsweep)"
        return shlex.join(argv) if argv else "(no speculative arguments: the engine's default, off)"

    def add(be, w, t, level, method, k, basis, s, lo, hi, rests_on, note=""):
        rows.append({"backend": be, "workload": w, "temperature": t, "level": level,
                     "use": f"{method} k={k}" if method else "off", "method": method, "k": k,
                     "config": config(be, method, k if method else None), "basis": basis, "speedup": s, "low": lo,
                     "high": hi, "rests_on": rests_on, "note": note})

    static = d[~_loaded(d)]
    keys = {(r.backend, r.workload, float(r.temperature), int(r.batch_size)) for _, r in static.iterrows()}
    keys |= {(r.backend, r.workload, 0.0, int(r.batch_size)) for _, r in sims.iterrows()}
    for be, w, t, b in sorted(keys):
        g = static[(static.backend == be) & (static.workload == w) & (static.temperature == t) & (static.batch_size == b)]
        meas = g[g.speedup.notna()]
        sim = sims[(sims.backend == be) & (sims.workload == w) & (sims.batch_size == b)] if t == 0 else sims.iloc[0:0]
        sim_of = {(m, int(k)): s for m, k, s in zip(sim.method, sim.k, sim.speedup)}
        level = f"batch {b}"
        if len(meas):
            best = meas.loc[meas.speedup.idxmax()]
            k = int(best.num_speculative_tokens)
            ev = (f"measured {_f(best.speedup)}x [{_f(best.speedup_ci_low)}, {_f(best.speedup_ci_high)}] "
                  f"({best.method} k={k}, `{best.job}`)")
            on = best.speedup_ci_low > 1
            note = ""
            if sim_of:
                measured = {(m, int(kk)) for m, kk in zip(meas.method, meas.num_speculative_tokens)}
                ref = sim_of.get((best.method, k)) if on else 1.0
                alt = {mk: s for mk, s in sim_of.items() if mk not in measured}
                if ref is not None and alt:
                    (am, ak), a = max(alt.items(), key=lambda kv: kv[1])
                    if a > ref * (1 + SIM_MARGIN):
                        note = (f"the simulator ranks {am} k={ak} (not measured here) above it: {a:.2f}x simulated "
                                f"against {ref:.2f}x{' for the choice' if on else ' (off)'}; measure it")
            if on:
                add(be, w, t, level, best.method, k, "measured", best.speedup, best.speedup_ci_low, best.speedup_ci_high,
                    ev, note)
            else:
                why = ("no interval: too few batch pairs to tell (more prompts or repeats give one)"
                       if best.speedup > 1 and math.isnan(best.speedup_ci_low) else
                       "its interval includes 1" if best.speedup > 1 else "every method measured slower")
                add(be, w, t, level, None, None, "measured", best.speedup, best.speedup_ci_low, best.speedup_ci_high,
                    f"best {ev}: {why}", note)
        elif len(sim):
            s = sim.loc[sim.speedup.idxmax()]
            ev = (f"simulated {s.speedup:.2f}x (fixed:{s.method}:{int(s.k)} on `{s.traces}` under the sweep's fitted cost "
                  f"model; no measured row at batch {b})")
            if s.speedup > 1:
                add(be, w, t, level, s.method, int(s.k), "simulated", s.speedup, math.nan, math.nan, ev)
            else:
                add(be, w, t, level, None, None, "simulated", s.speedup, math.nan, math.nan, f"best {ev}: below 1")
    loaded = d[_loaded(d)]
    groups = loaded.groupby(["backend", "workload", "temperature", "load_kind", "load_level"]) if len(loaded) else []
    for (be, w, t, kind, lvl), g in groups:
        meas = g[g.tpot_speedup.notna()]
        if not len(meas):
            continue
        best = meas.loc[meas.tpot_speedup.idxmax()]
        k = int(best.num_speculative_tokens)
        ev = (f"measured tpot_speedup {_f(best.tpot_speedup)} [{_f(best.tpot_speedup_low)}, {_f(best.tpot_speedup_high)}] "
              f"(the repeats' range; {best.method} k={k}, `{best.job}`)")
        if best.tpot_speedup_low > 1:  # a single repeat's range is the point itself
            add(be, w, float(t), f"{kind} {lvl:g}", best.method, k, "measured", best.tpot_speedup, best.tpot_speedup_low,
                best.tpot_speedup_high, ev)
        else:
            add(be, w, float(t), f"{kind} {lvl:g}", None, None, "measured", best.tpot_speedup, best.tpot_speedup_low,
                best.tpot_speedup_high, f"best {ev}: not every repeat improved p50 TPOT")
    return pd.DataFrame(rows, columns=cols), notes


def markdown(tuned: pd.DataFrame, notes: list[str]) -> str:
    lines = ["## Tuned engine configs", "",
             "Per engine: the method and draft length k to run, or off, for each workload, temperature and batch size "
             "(or load level), in the engine's own syntax, and the speedup it rests on (a 95% interval over the "
             "pairs; at a load point, p50 TPOT with SD off over on, the bracket the repeats' range). Measured rows "
             "decide; *simulated* marks a batch size without a measured row, where specsweep-oracle's fixed-k "
             "simulation on the sweep's traces and fitted cost model decided (bench/tuned.py).", ""]
    if tuned.empty:
        return "\n".join(lines + ["No speculative job completed.", ""] + [f"- {n}" for n in notes]) + "\n"
    for be, g in tuned.groupby("backend", sort=True):
        lines += [f"### {be}", "", "| workload | T | batch / load | use | config | rests on |", "|---|---|---|---|---|---|"]
        for _, r in g.iterrows():
            use = f"**{r.use}**" + (" (simulated)" if r.basis == "simulated" else "")
            cfg = r.config if r.config.startswith(("n/a", "(no")) else f"`{r.config}`"
            rest = r.rests_on + (f"; {r.note}" if r.note else "")
            lines.append(f"| {r.workload} | {r.temperature:g} | {r.level} | {use} | {cfg.replace('|', '/')} | "
                         f"{rest.replace('|', '/')} |")
        lines.append("")
    if notes:
        lines += ["Simulator:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)
