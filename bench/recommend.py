"""The decision report: per workload, batch size and temperature, which method to switch on, or
"off", with the reason in numbers. Measurements decide; the seed's rules of thumb are used only
where a measurement is missing, and a rule that the measurements contradict is said so.

Rules of thumb (from the project's original design notes):
- alpha x k < 1: fewer than one accepted token per cycle on average predicts a slowdown;
- draft_fraction >= 0.2: a drafter taking a fifth of the cycle or more is too expensive to pay;
- batch size >= 32: speculative gains shrink as the target's forward stops being memory-bound.
"""
from __future__ import annotations

import math

import pandas as pd

from .methods import speculative_rows


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


def _evidence(r) -> str:
    return (f"speedup {_f(r.get('speedup'))} [{_f(r.get('speedup_ci_low'))}, {_f(r.get('speedup_ci_high'))}], "
            f"alpha {_f(r.get('acceptance_rate'))}, verify {_f(r.get('verify_fraction'), '{:.0%}')}, "
            f"draft {_f(r.get('draft_fraction'), '{:.0%}')} of the cycle, draft cost c {_f(r.get('draft_cost_ratio'))}")


def recommend(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (backend, workload, batch_size, temperature): choice, reason, contradictions.
    Speedups are against each engine's own baseline, so engines are not ranked against each other."""
    if df.empty:
        return pd.DataFrame(columns=["backend", "workload", "batch_size", "temperature", "choice", "reason", "notes"])
    d = df[(df.status == "ok") & speculative_rows(df)].copy()
    for col in ("speedup", "speedup_ci_low", "speedup_ci_high"):  # no interval (one pair) is null in summary.json
        if col in d.columns:
            d[col] = pd.to_numeric(d[col], errors="coerce")
    if "backend" not in d.columns:
        d["backend"] = "-"
    rows = []
    for (be, w, b, t), g in d.groupby(["backend", "workload", "batch_size", "temperature"]):
        measured = g[g.speedup.notna()]
        notes = []
        for _, r in g.iterrows():
            for rule, slow in rules_of_thumb(r):
                if math.isnan(r.get("speedup", math.nan)):
                    continue
                if slow and r.speedup_ci_low > 1:
                    notes.append(f"{r.method}: rule '{rule}' predicts a slowdown, but it measured {_f(r.speedup)}x "
                                 f"[{_f(r.speedup_ci_low)}, {_f(r.speedup_ci_high)}]")
                elif not slow and "alpha" in rule and r.speedup_ci_high < 1:
                    notes.append(f"{r.method}: rule '{rule}' does not predict a slowdown, but it measured "
                                 f"{_f(r.speedup)}x [{_f(r.speedup_ci_low)}, {_f(r.speedup_ci_high)}]")
        if len(measured):
            best = measured.sort_values("speedup", ascending=False).iloc[0]
            name = best.method
            if best.speedup_ci_low > 1:
                choice, reason = name, f"{name}: {_evidence(best)}"
            elif best.speedup > 1:
                choice, reason = "off", (f"no method is clearly faster: best is {name}, whose interval includes 1 "
                                         f"({_evidence(best)})")
            else:
                choice, reason = "off", f"every method is slower; best is {name} ({_evidence(best)})"
        else:  # no timing: fall back on the rules of thumb over what was measured
            cands = []
            for _, r in g.iterrows():
                rules = rules_of_thumb(r)
                if rules and not any(slow for _, slow in rules):
                    cands.append((r.get("acceptance_rate") or 0, r.method, rules))
            if cands:
                _, m, rules = max(cands)
                choice, reason = m, "no speedup measured; by rule of thumb: " + "; ".join(x for x, _ in rules)
            else:
                choice, reason = "off", "no speedup measured, and the rules of thumb predict no gain"
        rows.append({"backend": be, "workload": w, "batch_size": b, "temperature": t, "choice": choice, "reason": reason,
                     "notes": "; ".join(notes)})
    return pd.DataFrame(rows)


def markdown(rec: pd.DataFrame) -> str:
    lines = ["## Recommendation", "",
             "Per engine, workload, batch size and temperature: the method to switch on (its 95% interval above 1), "
             "or off. Each speedup is against the same engine without speculation.", ""]
    if rec.empty:
        return "\n".join(lines + ["No speculative job completed.", ""])
    lines += ["| engine | workload | batch | T | use | why |", "|---|---|---|---|---|---|"]
    for _, r in rec.iterrows():
        lines.append(f"| {r.backend} | {r.workload} | {r.batch_size} | {r.temperature:g} | **{r.choice}** | {r.reason} |")
    notes = [f"- {r.backend}, {r.workload}, batch {r.batch_size}, T={r.temperature:g}: {r.notes}" for _, r in rec.iterrows()
             if r.notes]
    if notes:
        lines += ["", "Rules of thumb contradicted by the measurements:", ""] + notes
    return "\n".join(lines) + "\n"
