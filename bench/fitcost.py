"""`specsweep-fit-cost RESULTS_DIR`: fit the oracle's cost model to specsweep's own measured cycles.

From every job's cycles.parquet (a batched cycle counted once):
- target forward: least squares  t_verify ~ c_kv * kv_tokens + c_compute * batched_tokens + c_fixed,
  where kv_tokens sums the rows' KV lengths and batched_tokens = rows x (longest draft + 1), the
  tokens the engine's verify pass really processes;
- each neural drafter: t_draft ~ c_kv * kv_tokens + c_tokens * (k + 1) + c_fixed (linear), plus
  c_missed * missed where it sat out cycles (an adaptive policy's): missed = what a draft model
  feeds before drafting, the tokens the row emitted since it last drafted, or at its first draft
  the whole context (it is prefilled when first picked; missed_tokens);
- n-gram: t_draft as a fraction of t_verify (median), as the published model has it;
- overhead per step: the median of t_other.
Jobs whose cycles name their drafter (draft_source: combined, adaptive) fit each named method's
drafter from the cycles it drafted alone; cycles of mixed rows enter the target fit only.
The fit's error (relative RMS and R^2) is printed and written beside the coefficients.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from omegaconf import OmegaConf

from .methods import drafter_kind, known_methods
from .metrics import batched_cycles
from .results import find_sweep_dirs, load_summaries


def unique_cycles(sweep_dir: Path) -> pd.DataFrame:
    frames = []
    for _, s in load_summaries(sweep_dir).iterrows():
        f = Path(sweep_dir) / s.job / "cycles.parquet"
        if s.get("status") != "ok" or not f.exists():
            continue
        c = pd.read_parquet(f)
        if c.empty:
            continue
        g = batched_cycles(c)
        if "draft_source" in c.columns:  # the tokens each cycle's drafter had not seen (c_missed's regressor)
            keys = [k for k in ("run", "repeat", "batch", "cycle") if k in c.columns]
            g = g.merge(c.assign(missed=missed_tokens(c)).groupby(keys).missed.max().reset_index(), on=keys, how="left")
        g["batched_tokens"] = g.rows * (g.kmax + 1)
        g["method"] = np.where(g.run == "baseline", "autoregressive", s.method)
        job_cfg = Path(sweep_dir) / s.job / "config.yaml"
        g["drafter"] = np.where(g.run == "baseline", "none", drafter_kind(OmegaConf.load(job_cfg).method if
                                                                          job_cfg.exists() else s.method))
        g["job"] = s.job
        # A method whose cycles name their drafter (draft_source: combined, adaptive): a batched
        # cycle drafted by one method only fits that method's drafter (a plain step, "off", fits
        # the target alone); one whose rows mixed drafters, or named no method of specsweep's
        # (combined's "neural"), counts for the target fit only.
        g["mixed_drafters"] = False
        if "draft_source" in c.columns:
            keys = [k for k in ("run", "repeat", "batch", "cycle") if k in c.columns]
            one = c.groupby(keys).draft_source.agg(lambda x: x.iloc[0] if x.nunique(dropna=False) == 1 else None)
            g = g.merge(one.rename("source").reset_index(), on=keys, how="left")
            known = {**known_methods(), "off": "none"}
            named = g.source.isin(list(known)) & (g.run != "baseline")
            g.loc[named, "method"] = g.loc[named, "source"].replace({"off": "autoregressive"})
            g.loc[named, "drafter"] = g.loc[named, "source"].map(known)
            g["mixed_drafters"] = ~named & (g.run != "baseline")
            g = g.drop(columns="source")
        frames.append(g)
    if not frames:
        raise ValueError(f"{sweep_dir}: no cycles.parquet in completed jobs")
    return pd.concat(frames, ignore_index=True)


def missed_tokens(c: pd.DataFrame) -> np.ndarray:
    """Per row and cycle of a job whose cycles name their drafter (draft_source): what that
    drafter fed before drafting, the simulator's simulate.missed_tokens on measured cycles: the
    tokens the row emitted since the drafter last drafted for it, or at its first draft in the
    row the whole context (kv_len: the native engine prefills a draft model when first picked)."""
    keys = [k for k in ("run", "repeat", "batch") if k in c.columns] + ["row"]
    out = np.zeros(len(c))
    pos = {ix: i for i, ix in enumerate(c.index)}
    for _, g in c.sort_values("cycle").groupby(keys):
        before, last_end = 0, {}
        for ix, source, emitted, kv in zip(g.index, g.draft_source, g.emitted, g.kv_len):
            out[pos[ix]] = before - last_end[source] if source in last_end else kv
            before += int(emitted)
            last_end[source] = before
    return out


def _lstsq(X: np.ndarray, y: np.ndarray):
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    pred = X @ coef
    rel_rms = float(np.sqrt(np.mean(((pred - y) / y) ** 2)))
    r2 = float(1 - np.sum((y - pred) ** 2) / np.sum((y - y.mean()) ** 2)) if len(y) > 1 and y.std() > 0 else float("nan")
    return coef, rel_rms, r2


def fit_target(kv_tokens, batched_tokens, seconds) -> tuple[dict, dict]:
    """The target forward's model by least squares, t ~ c_kv * kv_tokens + c_compute *
    batched_tokens + c_fixed (c_kv: the context term, KV read per token attended to), from any
    timed forwards: a sweep's cycles, or forwards timed at chosen context lengths. Returns the
    coefficients and the fit (relative RMS error, R^2, points)."""
    X = np.column_stack([kv_tokens, batched_tokens, np.ones(len(seconds))]).astype(float)
    (c_kv, c_compute, c_fixed), err, r2 = _lstsq(X, np.asarray(seconds, float))
    return ({"c_kv": float(c_kv), "c_compute": float(c_compute), "c_fixed": float(c_fixed)},
            {"relative_rms_error": err, "r2": r2, "points": len(seconds)})


def fit(cycles: pd.DataFrame, name: str = "fitted") -> dict:
    target, err = fit_target(cycles.kv_tokens, cycles.batched_tokens, cycles.t_verify)
    model = {"name": name, "target": target,
             "overhead_per_step": float(cycles.t_other.median()), "switching_cost": 0.0, "drafters": {},
             "fit": {"target": {"cycles": len(cycles), "relative_rms_error": err["relative_rms_error"], "r2": err["r2"]}}}
    mixed = cycles.mixed_drafters if "mixed_drafters" in cycles else False
    drafts = (cycles.drafter if "drafter" in cycles else cycles.method.map(drafter_kind)) != "none"  # not a plain step
    for m, g in cycles[drafts & (cycles.kmax > 0) & ~mixed].groupby("method"):
        kind = g.drafter.iloc[0] if "drafter" in g else drafter_kind(m)
        if kind in ("lookup", "synthetic"):  # no model forward: its drafting time is a share of the verify's
            model["drafters"][m] = {"kind": "relative", "fraction": float((g.t_draft / g.t_verify).median())}
            model["fit"][m] = {"cycles": len(g), "t_draft_median_s": float(g.t_draft.median())}
            continue
        Xd = np.column_stack([g.kv_tokens, g.kmax + 1, np.ones(len(g))]).astype(float)
        y = g.t_draft.to_numpy(float)
        (dk, dt, df), derr, dr2 = _lstsq(Xd, y)
        model["drafters"][m] = {"kind": "linear", "c_kv": float(dk), "c_tokens": float(dt), "c_fixed": float(df)}
        model["fit"][m] = {"cycles": len(g), "relative_rms_error": derr, "r2": dr2}
        missed = g.missed.fillna(0).to_numpy(float) if "missed" in g else np.zeros(len(g))
        if (missed > 0).any():  # it sat out cycles (an adaptive policy): what it fed first is a term of its own
            (dk, dt, df, dm), merr, mr2 = _lstsq(np.column_stack([Xd, missed]), y)
            if dm > 0:  # a negative cost per token fed is noise: the fit without the term stands
                model["drafters"][m] = {"kind": "linear", "c_kv": float(dk), "c_tokens": float(dt), "c_fixed": float(df),
                                        "c_missed": float(dm)}
                model["fit"][m] = {"cycles": len(g), "relative_rms_error": merr, "r2": mr2,
                                   "cycles_after_sitting_out": int((missed > 0).sum()),
                                   "without_c_missed": {"relative_rms_error": derr, "r2": dr2}}
    model["source"] = "fitted by specsweep-fit-cost on measured cycles"
    return model


def fit_prefill(sweep_dir: Path) -> dict | None:
    """Prefill seconds ~ c_tokens * prompt_tokens + c_fixed, from the TTFT of batch-1 requests."""
    xs, ys = [], []
    for _, s in load_summaries(sweep_dir).iterrows():
        f = Path(sweep_dir) / s.job / "requests.parquet"
        if s.get("status") != "ok" or s.get("batch_size") != 1 or not f.exists():
            continue
        r = pd.read_parquet(f, columns=["n_prompt", "ttft_s"])
        xs += r.n_prompt.tolist()
        ys += r.ttft_s.tolist()
    if len(set(xs)) < 2:
        return None
    (c_tok, c_fix), err, r2 = _lstsq(np.column_stack([xs, np.ones(len(xs))]).astype(float), np.asarray(ys, float))
    return {"c_tokens": float(c_tok), "c_fixed": float(c_fix), "fit": {"requests": len(xs), "relative_rms_error": err, "r2": r2}}


def fit_sweep(sweep_dir: Path, name: str | None = None) -> dict:
    """The whole cost model of a sweep: target, drafters, overhead and (from batch-1 TTFTs) prefill."""
    model = fit(unique_cycles(sweep_dir), name or f"fitted-{Path(sweep_dir).name}")
    pre = fit_prefill(sweep_dir)
    if pre is not None:
        model["fit"]["prefill"] = pre.pop("fit")
        model["prefill"] = pre
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specsweep-fit-cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir", help="a sweep folder whose jobs have cycles.parquet")
    ap.add_argument("--out", help="cost model YAML (default: <results_dir>/cost_model.yaml)")
    ap.add_argument("--name", default=None)
    a = ap.parse_args(argv)
    sweeps = find_sweep_dirs(Path(a.results_dir))
    if len(sweeps) != 1:
        print(f"specsweep-fit-cost: {a.results_dir}: expected one sweep folder with job results, found {len(sweeps)}",
              file=sys.stderr)
        return 2
    try:
        model = fit_sweep(sweeps[0], a.name)
    except ValueError as e:
        print(f"specsweep-fit-cost: {e}", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else sweeps[0] / "cost_model.yaml"
    out.write_text(yaml.safe_dump(model, sort_keys=False))
    t = model["target"]
    f = model["fit"]["target"]
    print(f"target forward = {t['c_kv']:.3e} * kv + {t['c_compute']:.3e} * batched + {t['c_fixed']:.3e} s "
          f"(relative RMS error {100 * f['relative_rms_error']:.1f}%, R^2 {f['r2']:.3f}, {f['cycles']} cycles)")
    for m, d in model["drafters"].items():
        print(f"{m}: {d}  fit {model['fit'][m]}")
    if "prefill" in model:
        p, pf = model["prefill"], model["fit"]["prefill"]
        print(f"prefill = {p['c_tokens']:.3e} * prompt_tokens + {p['c_fixed']:.3e} s (relative RMS error "
              f"{100 * pf['relative_rms_error']:.1f}%, {pf['requests']} batch-1 requests)")
    print(f"overhead per step {model['overhead_per_step']:.3e} s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
