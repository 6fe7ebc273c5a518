"""The decision report: per engine, workload and temperature, and per batch size (static batches,
and input length where the sweep set one) or load level (load points), the method and draft
length k to run, or off, written in the engine's own syntax by its adapter (Backend.engine_config:
vLLM's --speculative-config JSON, SGLang's server arguments, llama-server's flags, specsweep's
overrides for the engines whose loop is specsweep's), with the measurement it rests on.

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
- Rules of thumb (from the project's original design notes) decide only where nothing was
  measured or simulated, and a rule the measurements contradict is said so beside the choice:
  alpha x k < 1 (fewer than one accepted token per cycle) predicts a slowdown; a drafter taking a
  fifth of the cycle or more (draft_fraction >= 0.2) is too expensive to pay; at batch 32 and up
  the target's forward stops being memory-bound and gains shrink.
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


def rules_of_thumb(r) -> list[tuple[str, bool]]:
    """(rule, predicts_slowdown) for the rules that apply to a job's known values."""
    out = []
    a, k = r.get("acceptance_rate"), r.get("num_speculative_tokens")
    if a is not None and not math.isnan(a) and k:
        out.append((f"alpha x k = {a * k:.2f} {'<' if a * k < 1 else '>='} 1", a * k < 1))
    d = r.get("draft_fraction")
    if d is not None and not math.isnan(d):
        out.append((f"draft fraction {d:.0%} {'>=' if d >= 0.2 else '<'} 20%", d >= 0.2))
    if r.get("batch_size", 0) >= 32:
        out.append((f"batch size {r['batch_size']} >= 32", True))
    return out


def _contradictions(g: pd.DataFrame) -> list[str]:
    """Each rule of thumb a measured row contradicts: a predicted slowdown that measured a clear
    speedup, or an acceptance rule that predicted none and measured a clear slowdown."""
    notes = []
    for _, r in g[g.speedup.notna()].iterrows():
        for rule, slow in rules_of_thumb(r):
            if slow and r.speedup_ci_low > 1:
                notes.append(f"{r.method}: rule '{rule}' predicts a slowdown, but it measured {_f(r.speedup)}x "
                             f"[{_f(r.speedup_ci_low)}, {_f(r.speedup_ci_high)}]")
            elif not slow and "alpha" in rule and r.speedup_ci_high < 1:
                notes.append(f"{r.method}: rule '{rule}' does not predict a slowdown, but it measured "
                             f"{_f(r.speedup)}x [{_f(r.speedup_ci_low)}, {_f(r.speedup_ci_high)}]")
    return notes


def _evidence(r) -> str:
    """What a measured row says beyond its speedup: acceptance and where the cycle's time went."""
    return (f"alpha {_f(r.get('acceptance_rate'))}, verify {_f(r.get('verify_fraction'), '{:.0%}')}, "
            f"draft {_f(r.get('draft_fraction'), '{:.0%}')} of the cycle, draft cost c {_f(r.get('draft_cost_ratio'))}")


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


def job_method_config(mcfg: dict, backend: str, method: str) -> dict:
    """The method config a job of the sweep ran `method` with on `backend` (method_configs), else
    the method's defaults."""
    return mcfg.get((backend, method)) or {**method_defaults(method), "name": method}


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


COLUMNS = ["backend", "workload", "temperature", "level", "use", "method", "k", "config", "basis", "speedup", "low",
           "high", "rests_on", "note"]


def decide(df: pd.DataFrame, sweep_dir: Path) -> tuple[pd.DataFrame, list[str]]:
    """One row per (backend, workload, temperature, level): use (method k=K or off), config (the
    engine's own syntax), basis (measured | simulated | rule of thumb), speedup, low, high,
    rests_on (the row and what it measured), note (a simulated alternative, a contradicted rule of
    thumb); and the simulator's notes. Speedups are against each engine's own baseline, so engines
    are never ranked against each other."""
    if df.empty or "status" not in df.columns:
        return pd.DataFrame(columns=COLUMNS), []
    d = df[(df.status == "ok") & speculative_rows(df)]
    if "acceptance_forced" in d.columns:  # a synthetic method measures the engine, not a config to run
        d = d[d.acceptance_forced.fillna(False) != True]  # noqa: E712 - a column of bools and NaN
    if d.empty:
        return pd.DataFrame(columns=COLUMNS), []
    for col in ("backend", "job"):  # rows without them (hand-made, or from before rows named their engine)
        if col not in d.columns:
            d = d.assign(**{col: "-"})
    d = _num(d, ["speedup", "speedup_ci_low", "speedup_ci_high", "tpot_speedup", "tpot_speedup_low", "tpot_speedup_high"])
    sims, notes = simulate_missing(d, sweep_dir)
    rows = _Rows(engine_classes(d, sweep_dir), method_configs(d, sweep_dir))
    static = d[~_loaded(d)]
    # an input length set by the sweep (prompt_tokens) is a level of its own: one k per length
    length = (static.prompt_tokens.fillna(0).astype(int) if "prompt_tokens" in static.columns
              else pd.Series(0, index=static.index))
    keys = {(r.backend, r.workload, float(r.temperature), int(r.batch_size), n) for (_, r), n in
            zip(static.iterrows(), length)}
    keys |= {(r.backend, r.workload, 0.0, int(r.batch_size), 0) for _, r in sims.iterrows()}
    for be, w, t, b, n in sorted(keys):
        g = static[(static.backend == be) & (static.workload == w) & (static.temperature == t) & (static.batch_size == b)
                   & (length == n)]
        sim = (sims[(sims.backend == be) & (sims.workload == w) & (sims.batch_size == b)] if t == 0 and not n
               else sims.iloc[0:0])
        _static_choice(rows, (be, w, t, f"batch {b}" + (f", in {n}" if n else "")), g, sim, b)
    loaded = d[_loaded(d)]
    groups = loaded.groupby(["backend", "workload", "temperature", "load_kind", "load_level"]) if len(loaded) else []
    for (be, w, t, kind, lvl), g in groups:
        _load_choice(rows, (be, w, float(t), f"{kind} {lvl:g}"), g[g.tpot_speedup.notna()])
    return pd.DataFrame(rows.rows, columns=COLUMNS), notes


class _Rows:
    """The tuned configs being collected, each with its engine's own config line."""

    def __init__(self, classes: dict, mcfg: dict):
        self.classes, self.mcfg, self.rows = classes, mcfg, []

    def config(self, be, method, k) -> str:
        cls = self.classes.get(be)
        if cls is None or isinstance(cls, str):
            return f"n/a: {cls or 'no job config names its adapter'}"
        cfg = job_method_config(self.mcfg, be, method) if method else {}
        try:
            argv = cls.engine_config(cfg, k)
        except ValueError as e:
            return f"n/a on this engine: {e}"
        if argv is None:
            return "n/a: the adapter does not say (the engine is configured outside specsweep)"
        return shlex.join(argv) if argv else "(no speculative arguments: the engine's default, off)"

    def add(self, where: tuple, method, k, basis, s, lo, hi, rests_on, note=""):
        be, w, t, level = where
        self.rows.append({"backend": be, "workload": w, "temperature": t, "level": level,
                          "use": f"{method} k={k}" if method else "off", "method": method, "k": k,
                          "config": self.config(be, method, k if method else None), "basis": basis, "speedup": s,
                          "low": lo, "high": hi, "rests_on": rests_on, "note": note})


def _static_choice(rows: _Rows, where: tuple, g: pd.DataFrame, sim: pd.DataFrame, b: int) -> None:
    """A batch size's choice: the measured row with the highest speedup, on if its interval lies
    above 1 (with a note where the simulator ranks an unmeasured method above it, or a rule of
    thumb the measurements contradict); else, without a measured row, the simulator's best; else
    the rules of thumb over what was measured."""
    meas = g[g.speedup.notna()]
    sim_of = {(m, int(k)): s for m, k, s in zip(sim.method, sim.k, sim.speedup)}
    if len(meas):
        best = meas.loc[meas.speedup.idxmax()]
        k = int(best.num_speculative_tokens)
        ev = (f"measured {_f(best.speedup)}x [{_f(best.speedup_ci_low)}, {_f(best.speedup_ci_high)}] "
              f"({best.method} k={k}, `{best.job}`; {_evidence(best)})")
        on = best.speedup_ci_low > 1
        note = "; ".join(filter(None, [_simulated_alternative(meas, sim_of, best, k, on), *_contradictions(meas)]))
        if on:
            rows.add(where, best.method, k, "measured", best.speedup, best.speedup_ci_low, best.speedup_ci_high, ev, note)
        else:
            why = ("no interval: too few batch pairs to tell (more prompts or repeats give one)"
                   if best.speedup > 1 and math.isnan(best.speedup_ci_low) else
                   "its interval includes 1" if best.speedup > 1 else "every method measured slower")
            rows.add(where, None, None, "measured", best.speedup, best.speedup_ci_low, best.speedup_ci_high,
                     f"best {ev}: {why}", note)
    elif len(sim):
        s = sim.loc[sim.speedup.idxmax()]
        ev = (f"simulated {s.speedup:.2f}x (fixed:{s.method}:{int(s.k)} on `{s.traces}` under the sweep's fitted cost "
              f"model; no measured row at batch {b})")
        if s.speedup > 1:
            rows.add(where, s.method, int(s.k), "simulated", s.speedup, math.nan, math.nan, ev)
        else:
            rows.add(where, None, None, "simulated", s.speedup, math.nan, math.nan, f"best {ev}: below 1")
    elif len(g):
        _rule_of_thumb_choice(rows, where, g)


def _rule_of_thumb_choice(rows: _Rows, where: tuple, g: pd.DataFrame) -> None:
    """No speedup measured or simulated (an engine without a timed baseline): the method with the
    highest acceptance among those no rule of thumb predicts a slowdown for, else off."""
    cands = []
    for _, r in g.iterrows():
        rules = rules_of_thumb(r)
        if rules and not any(slow for _, slow in rules):
            cands.append((r.get("acceptance_rate") or 0, r.method, int(r.num_speculative_tokens), rules))
    if cands:
        _, m, k, rules = max(cands)
        rows.add(where, m, k, "rule of thumb", math.nan, math.nan, math.nan,
                 "no speedup measured; by rule of thumb: " + "; ".join(x for x, _ in rules))
    else:
        rows.add(where, None, None, "rule of thumb", math.nan, math.nan, math.nan,
                 "no speedup measured, and the rules of thumb predict no gain")


def _simulated_alternative(meas: pd.DataFrame, sim_of: dict, best, k: int, on: bool) -> str:
    """A note where the simulator ranks a method not measured here above the choice (or above off)."""
    if not sim_of:
        return ""
    measured = {(m, int(kk)) for m, kk in zip(meas.method, meas.num_speculative_tokens)}
    ref = sim_of.get((best.method, k)) if on else 1.0
    alt = {mk: s for mk, s in sim_of.items() if mk not in measured}
    if ref is None or not alt:
        return ""
    (am, ak), a = max(alt.items(), key=lambda kv: kv[1])
    if a <= ref * (1 + SIM_MARGIN):
        return ""
    return (f"the simulator ranks {am} k={ak} (not measured here) above it: {a:.2f}x simulated "
            f"against {ref:.2f}x{' for the choice' if on else ' (off)'}; measure it")


def _load_choice(rows: _Rows, where: tuple, meas: pd.DataFrame) -> None:
    """A load level's choice: the row with the highest tpot_speedup, on if every repeat improved."""
    if not len(meas):
        return
    best = meas.loc[meas.tpot_speedup.idxmax()]
    k = int(best.num_speculative_tokens)
    ev = (f"measured tpot_speedup {_f(best.tpot_speedup)} [{_f(best.tpot_speedup_low)}, {_f(best.tpot_speedup_high)}] "
          f"(the repeats' range; {best.method} k={k}, `{best.job}`)")
    if best.tpot_speedup_low > 1:  # a single repeat's range is the point itself
        rows.add(where, best.method, k, "measured", best.tpot_speedup, best.tpot_speedup_low, best.tpot_speedup_high, ev)
    else:
        rows.add(where, None, None, "measured", best.tpot_speedup, best.tpot_speedup_low, best.tpot_speedup_high,
                 f"best {ev}: not every repeat improved p50 TPOT")


def batch_schedule(choices: list[tuple[int, str | None, int | None]], method: str) -> list[tuple[int, int, int]]:
    """A draft length per batch size for one method, from the choices at each measured batch size
    ((batch, method chosen or None for off, k)): each measured batch size's k holds from it up to
    the next measured one (the first from batch 1, the last open-ended: the engine carries it on),
    0 where speculation is off or another method was chosen there."""
    pts = sorted((b, k if m == method else 0) for b, m, k in choices)
    out = []
    for i, (b, k) in enumerate(pts):
        start = 1 if i == 0 else b
        end = pts[i + 1][0] - 1 if i + 1 < len(pts) else b
        out.append((start, end, int(k or 0)))
    return out


def schedules(tuned: pd.DataFrame, classes: dict, mcfg: dict | None = None) -> list[str]:
    """Per engine, workload and temperature whose choice varies with the batch size and whose
    adapter takes a schedule (Backend.engine_schedule): the one config that runs each measured
    batch size's choice, for the method chosen at the most batch sizes (with the method config a
    job ran it with, mcfg[(backend, method)], where given), and any file that config names."""
    out = []
    static = tuned[tuned.level.str.match(r"^batch \d+$")] if len(tuned) else tuned
    for (be, w, t), g in static.groupby(["backend", "workload", "temperature"], sort=True):
        cls = classes.get(be)
        chosen = g.method.dropna()
        if cls is None or isinstance(cls, str) or chosen.empty or len(g) < 2 or g.use.nunique() < 2:
            continue
        method = chosen.value_counts().index[0]
        choices = [(int(level.split()[1]), m if isinstance(m, str) else None, None if pd.isna(k) else int(k))
                   for level, m, k in zip(g.level, g.method, g.k)]
        sched = batch_schedule(choices, method)
        cfg = job_method_config(mcfg or {}, be, method)
        try:
            argv = cls.engine_schedule(cfg, sched)
        except ValueError as e:
            out.append(f"- {be}, {w}, T={t:g}: {method} with k per batch size {sched}: n/a on this engine: {e}")
            continue
        if argv:
            out.append(f"- {be}, {w}, T={t:g}: {method} with k per batch size {sched}: `{shlex.join(argv)}`")
            out += [f"  with `{name}` holding `{text}`" for name, text in cls.engine_schedule_files(cfg, sched).items()]
    if out:
        out = ["Batch-size schedules (one engine config for every measured batch size, where the engine takes a "
               "draft length per batch size; each k holds from its batch size up to the next one measured):", ""] + out
    return out + ([""] if out else [])


def markdown(tuned: pd.DataFrame, notes: list[str], classes: dict | None = None, mcfg: dict | None = None) -> str:
    lines = ["## What to run", "",
             "Per engine: the method and draft length k to switch on, or off, for each workload, temperature and batch "
             "size (or load level), in the engine's own syntax, and the measurement it rests on (speedup against the "
             "same engine without speculation, a 95% interval over the pairs; at a load point, p50 TPOT with SD off "
             "over on, the bracket the repeats' range). Measured rows decide; *simulated* marks a batch size without "
             "a measured row, where specsweep-oracle's fixed-k simulation on the sweep's traces and fitted cost model "
             "decided; *rule of thumb* one where nothing was timed (bench/decision.py).", ""]
    if tuned.empty:
        return "\n".join(lines + ["No speculative job completed.", ""] + [f"- {n}" for n in notes]) + "\n"
    for be, g in tuned.groupby("backend", sort=True):
        lines += [f"### {be}", "", "| workload | T | batch / load | use | config | rests on |", "|---|---|---|---|---|---|"]
        for _, r in g.iterrows():
            use = f"**{r.use}**" + (f" ({r.basis})" if r.basis != "measured" else "")
            cfg = r.config if r.config.startswith(("n/a", "(no")) else f"`{r.config}`"
            rest = r.rests_on + (f"; {r.note}" if r.note else "")
            lines.append(f"| {r.workload} | {r.temperature:g} | {r.level} | {use} | {cfg.replace('|', '/')} | "
                         f"{rest.replace('|', '/')} |")
        lines.append("")
    lines += schedules(tuned, classes or {}, mcfg)
    if notes:
        lines += ["Simulator:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)
