"""The oracle on acceptance traces under two cost models side by side: the published
Llama-3.1-8B/H100 model (SpecDecode-Bench) and the target forward a GPU run fitted
(benchmarks/gpu_validation.py writes it as OUT/cost_8b.yaml). How much do the bounds and the
best realizable rule move when the target's costs are this GPU's instead of the published ones?

  python benchmarks/gpu_oracle.py results/gpu/DATE-DEVICE/cost_8b.yaml TRACES.jsonl... --out DIR [specsweep-oracle options]

Runs on any machine (the oracle replays traces; no GPU). The GPU run's synthetic sweep measures
no real drafter, so the fitted model takes the published model's drafting costs (a neural
drafter's linear cost, a lookup's share of a verify) and differs only in the target forward
(c_kv, c_compute, c_fixed) and the overhead per step; gap.md says so. Options after the traces
go to specsweep-oracle unchanged for both runs (e.g. --batch-sizes 1 4 --accounting both).

Writes DIR/published/ and DIR/fitted/ (specsweep-oracle's folders), DIR/cost_fitted.yaml (the
model the second run used) and DIR/gap.csv / gap.md: per dataset, batch size and accounting,
the best fixed policy, the dp bound, the best realizable adaptive policy and its gap_closed,
under each model.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.costmodel import LLAMA31_8B_H100, load_cost_model  # noqa: E402
from bench.methods import drafts_without_model  # noqa: E402
from bench.oracle.simulate import GAP_KEYS  # noqa: E402
from bench.oracle.tracefile import load_traces  # noqa: E402

def fitted_with_published_drafters(fitted: Path, traces: list[str], out: Path) -> Path:
    """The fitted target with the published drafting cost of every method the traces hold."""
    target = load_cost_model(str(fitted))  # checks the file (a clear error naming it)
    methods = sorted({m for t in traces for tr in load_traces(t) for m in tr.acc})
    p = LLAMA31_8B_H100
    drafters = {m: asdict(p.default_ngram if drafts_without_model(m) else p.default_neural) for m in methods}
    d = {"name": "gpu-fitted-target", "source": f"target from {fitted}; drafters from {p.source}",
         "target": {"c_kv": target.c_kv, "c_compute": target.c_compute, "c_fixed": target.c_fixed},
         "overhead_per_step": target.overhead_per_step, "switching_cost": p.switching_cost, "drafters": drafters}
    path = out / "cost_fitted.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def group_keys(df: pd.DataFrame) -> list[str]:
    """The oracle's own groups, those its gap_closed is computed over (GAP_KEYS), but the half:
    every request is scored here."""
    return [k for k in GAP_KEYS if k in df and k != "half"]


def best_per_group(df: pd.DataFrame) -> pd.DataFrame:
    """Per group: the best fixed policy, the dp bound and the best realizable adaptive policy
    (every request scored: half all or both), with that policy's gap_closed."""
    if "half" in df:
        df = df[df.half.isin(["all", "both"])]
    df = df.dropna(subset=["speedup"])
    keys, rows = group_keys(df), []
    for key, g in df.groupby(keys):
        fixed, dp = g[g.kind == "fixed"], g[g.kind == "dp"]
        adaptive = g[g.realizable.astype(bool) & ~g.kind.isin(["fixed", "dp"])]
        r = dict(zip(keys, key))
        for name, part in (("best_fixed", fixed), ("best_realizable", adaptive)):
            top = part.loc[part.speedup.idxmax()] if len(part) else None
            r[name] = None if top is None else top.policy
            r[f"{name}_speedup"] = float("nan") if top is None else float(top.speedup)
            if name == "best_realizable":
                r["best_realizable_gap_closed"] = float("nan") if top is None else float(top.gap_closed)
        r["dp_speedup"] = float(dp.speedup.max()) if len(dp) else float("nan")
        rows.append(r)
    return pd.DataFrame(rows)


def compare(published: pd.DataFrame, fitted: pd.DataFrame) -> pd.DataFrame:
    mine, theirs = best_per_group(published), best_per_group(fitted)
    both = mine.merge(theirs, on=group_keys(mine), suffixes=("_published", "_fitted"))
    for col in ("best_fixed_speedup", "dp_speedup", "best_realizable_speedup"):
        both[f"{col}_ratio"] = both[f"{col}_fitted"] / both[f"{col}_published"]
    return both


def markdown(gap: pd.DataFrame, fitted_yaml: Path) -> str:
    cells = lambda r, s: (f"{r['best_fixed_' + s]} {r['best_fixed_speedup_' + s]:.2f} | {r['dp_speedup_' + s]:.2f} | "
                          f"{r['best_realizable_' + s]} {r['best_realizable_speedup_' + s]:.2f} "
                          f"({r['best_realizable_gap_closed_' + s]:+.2f})")
    lines = ["# The oracle under the published and the GPU-fitted cost model", "",
             f"Fitted target: `{fitted_yaml}`; drafting costs as published ({LLAMA31_8B_H100.source}). "
             "Speedup of the best fixed policy, the dp bound, and the best realizable adaptive policy "
             "(its gap_closed = (policy - best fixed) / (dp - best fixed)).", "",
             "| dataset | batch | accounting | published: best fixed | dp | best realizable | "
             "fitted: best fixed | dp | best realizable | dp fitted / published |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in gap.iterrows():
        charge = f", draft charged per {r.neural_draft_charge}" if gap.neural_draft_charge.nunique() > 1 else ""
        lines.append(f"| {r.dataset} | {r.batch_size} | {r.accounting}{charge} | {cells(r, 'published')} | {cells(r, 'fitted')} "
                     f"| {r.dp_speedup_ratio:.2f} |")
    return "\n".join(lines) + "\n"


def oracle(traces: list[str], cost: str, out: Path, extra: list[str]) -> pd.DataFrame:
    r = subprocess.run([sys.executable, "-m", "bench.oracle", *traces, "--cost-model", cost, "--out", str(out), *extra],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"specsweep-oracle under {cost} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return pd.read_csv(out / "oracle.csv")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cost", type=Path, help="the GPU run's fitted cost model (OUT/cost_8b.yaml)")
    ap.add_argument("traces", nargs="+", help="trace files (the published combined_*.jsonl, or specsweep-trace's)")
    ap.add_argument("--out", type=Path, required=True)
    a, extra = ap.parse_known_args(argv)
    if not a.cost.is_file():
        ap.error(f"{a.cost}: no such file; give the cost_8b.yaml a GPU run wrote")
    missing = [t for t in a.traces if not Path(t).is_file()]
    if missing:
        ap.error(f"trace file(s) not found: {', '.join(missing)}")
    a.out.mkdir(parents=True, exist_ok=True)
    fitted_yaml = fitted_with_published_drafters(a.cost, a.traces, a.out)
    gap = compare(oracle(a.traces, LLAMA31_8B_H100.name, a.out / "published", extra),
                  oracle(a.traces, str(fitted_yaml), a.out / "fitted", extra))
    gap.to_csv(a.out / "gap.csv", index=False)
    md = markdown(gap, a.cost)
    (a.out / "gap.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
