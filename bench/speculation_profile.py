"""A job's acceptance as a portable profile: `speculation_profile.json` in every job folder whose
method drafted, in the layout of NVIDIA Model-Optimizer's specdec_bench (schema "1.0": the keys
of its speculation_profile.py `build_profile`, read from its source; the values are computed
here from specsweep's own acceptance record, under docs/metrics.md's definitions). Read back,
a profile drives `method=synthetic method.profile_path=FILE` on any engine, so an engine's cost
can be measured under another drafter's (or another harness's) acceptance, and it is written in
each engine's forced-acceptance syntax by `specsweep-profile FILE`.

Per draft position j = 1..K, over the verification steps that had a draft:
- marginal_accept_rates[j-1]    = steps that accepted the first j draft tokens / steps
                                  (non-increasing; what vLLM's synthetic_acceptance_rates and
                                  llama-server's --spec-synth-rates take)
- conditional_accept_rates[j-1] = marginal[j-1] / marginal[j-2] (position 1: marginal[0])
- mean_accept_length            = 1 + accepted tokens / steps (the bonus token included: tau)
so 1 + sum(marginal) equals mean_accept_length exactly; `validation` checks both that and the
marginals' monotonicity, as specdec_bench's profile does (tolerance 0.02).

A drafter that proposes fewer than K tokens on some steps (n-gram lookup) counts the positions
it did not reach as not accepted: the profile reproduces its acceptance lengths, while a
synthetic run always drafts K tokens (its verify width, and so its cost, is that of a full draft).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

SCHEMA_VERSION = "1.0"
TOLERANCE = 0.02  # specdec_bench's tolerance on the mean accept length's consistency
FILENAME = "speculation_profile.json"


class ProfileError(ValueError):
    """A profile file that cannot be used: names the file, the key and what is valid."""


def _method_steps(cycles: pd.DataFrame | None) -> pd.DataFrame:
    """The method arm's verification steps that had a draft (a batched step once per row)."""
    if cycles is None or not len(cycles) or "drafted" not in cycles.columns:
        return pd.DataFrame(columns=["request_id", "accepted"])
    steps = cycles[cycles.drafted > 0]
    return steps[steps.run != "baseline"] if "run" in steps.columns else steps


def _histogram(steps: pd.DataFrame) -> dict[str, int] | None:
    """{accept length: steps}: per verification step with a draft, accepted + 1 (the bonus token)."""
    if not len(steps):
        return None
    counts = (steps.accepted + 1).value_counts().sort_index()
    return {str(int(length)): int(n) for length, n in counts.items()}


def _per_request_mean(steps: pd.DataFrame) -> float | None:
    """Mean accept length of each request, averaged over requests (each request once)."""
    if not len(steps):
        return None
    g = steps.groupby("request_id").accepted.agg(["size", "sum"])
    return round(float((1 + g["sum"] / g["size"]).mean()), 6)


def _per_category(steps: pd.DataFrame, requests: pd.DataFrame | None) -> dict[str, float] | None:
    """Mean accept length per prompt category (1 + accepted / steps over its requests' steps)."""
    if not len(steps) or requests is None or "category" not in requests.columns:
        return None
    cats = requests.drop_duplicates("request_id").set_index("request_id").category
    steps = steps.assign(category=steps.request_id.map(cats))
    if steps.category.isna().all():
        return None
    g = steps.groupby("category").agg(n=("accepted", "size"), acc=("accepted", "sum"))
    return {str(c): round(1 + float(r.acc) / r.n, 6) for c, r in g.iterrows()}


def validation(marginal: list[float], reported: float | None) -> dict:
    implied = 1 + sum(marginal)
    delta = abs(implied - reported) if reported is not None and math.isfinite(reported) else None
    violations = [{"position": j, "value": v, "previous": marginal[j - 1]}
                  for j, v in enumerate(marginal) if j and v > marginal[j - 1] + 1e-12]
    return {"mean_consistency": {"implied_mean_accept_length": round(implied, 6),
                                 "reported_mean_accept_length": reported,
                                 "abs_delta": None if delta is None else round(delta, 6), "tolerance": TOLERANCE,
                                 "passed": delta is not None and delta <= TOLERANCE},
            "marginal_monotonicity": {"passed": not violations, "violations": violations}}


def build(row: dict, config: dict, cycles: pd.DataFrame | None = None,
          requests: pd.DataFrame | None = None) -> dict | None:
    """The profile of a finished job (its summary row and config; its cycle trace and requests where
    the engine keeps them), or None when the job has no per-position acceptance (it did not draft,
    or its engine reports no per-position counts)."""
    counts = row.get("acceptance_counts") or {}
    k = int(row.get("num_speculative_tokens") or 0)
    steps, per_pos = counts.get("drafts") or 0, list(counts.get("accepted_per_position") or [])[:k]
    if row.get("status") != "ok" or not steps or not per_pos:
        return None
    marginal = [round(a / steps, 6) for a in per_pos]
    conditional = [round(marginal[0], 6)] + [round(b / a, 6) if a else 0.0 for a, b in zip(marginal, marginal[1:])]
    tau = 1 + counts["accepted_tokens"] / steps
    method = config.get("method") or {}
    draft = next((method[key] for key in ("draft_path", "head_path", "profile_path") if method.get(key)), None)
    load = config.get("load") or {"kind": "static"}
    steps_traced = _method_steps(cycles)
    return {
        "schema_version": SCHEMA_VERSION, "measured": True, "method": row.get("method"),
        "draft_checkpoint": {"id": str(draft) if draft else row.get("method")},
        "target_model": {"id": row.get("model"), "path": (config.get("model") or {}).get("path")},
        "num_speculative_tokens": k, "block_size": None, "max_supported_k": k,
        "verification_method": "longest_prefix",
        "conditional_accept_rates": conditional, "marginal_accept_rates": marginal,
        "mean_accept_length": round(tau, 6),
        "mean_accept_length_per_request": _per_request_mean(steps_traced),
        "accept_length_model": "measured_per_k", "accept_length_by_k": {str(k): round(tau, 6)},
        "acceptance_length_histogram": _histogram(steps_traced), "per_category": _per_category(steps_traced, requests),
        "measurement_conditions": {
            "harness": "specsweep", "engine": row.get("backend"), "dataset": row.get("workload"),
            "batch_size": row.get("batch_size"), "load": load.get("kind"), "load_level": load.get("level"),
            "temperature": row.get("temperature"), "top_p": row.get("top_p"), "max_new_tokens": row.get("max_new_tokens"),
            "num_prompts": row.get("num_prompts"), "seed": row.get("seed"), "job": row.get("job"),
            "acceptance_forced": bool(row.get("acceptance_forced"))},
        "validation": validation(marginal, round(tau, 6)),
    }


def write(job_dir: Path, row: dict, config: dict) -> Path | None:
    """speculation_profile.json for a finished job, from its row, config and trace files; None
    (nothing written) when the job has no per-position acceptance."""
    from .results import write_json

    job_dir = Path(job_dir)
    read = lambda name: pd.read_parquet(job_dir / name) if (job_dir / name).exists() else None  # noqa: E731
    profile = build(row, config, read("cycles.parquet"), read("requests.parquet"))
    if profile is None:
        (job_dir / FILENAME).unlink(missing_ok=True)  # a rerun that no longer drafts leaves no stale profile
        return None
    write_json(job_dir / FILENAME, profile)
    return job_dir / FILENAME


def read(path) -> dict:
    """A profile file, checked: its schema version and marginal rates (numbers in [0, 1], non-increasing)."""
    p = Path(str(path)).expanduser()
    if not p.is_file():
        raise ProfileError(f"profile {str(path)!r}: no such file (a speculation_profile.json, which every specsweep "
                           "job that drafted writes in its folder)")
    try:
        prof = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"profile {p}: not JSON ({e})") from None
    if not isinstance(prof, dict) or str(prof.get("schema_version")) != SCHEMA_VERSION:
        got = prof.get("schema_version") if isinstance(prof, dict) else type(prof).__name__
        raise ProfileError(f"profile {p}: schema_version {got!r}; this version reads schema {SCHEMA_VERSION} "
                           "(Model-Optimizer specdec_bench's speculation_profile.json)")
    rates = prof.get("marginal_accept_rates")
    if (not isinstance(rates, list) or not rates or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                            and 0 <= x <= 1 for x in rates)):
        raise ProfileError(f"profile {p}: marginal_accept_rates={rates!r}; use a non-empty list of numbers in [0, 1] "
                           "(position j: the share of steps that accepted the first j draft tokens)")
    if any(b > a + 1e-9 for a, b in zip(rates, rates[1:])):
        raise ProfileError(f"profile {p}: marginal_accept_rates={rates} rise with the position; each is the share of "
                           "steps that accepted the first j draft tokens, so none may exceed the one before it")
    return prof


def marginal_rates(path, k: int) -> list[float]:
    """The first k marginal rates of a profile file, for a synthetic run at draft length k."""
    rates = [float(x) for x in read(path)["marginal_accept_rates"]]
    if len(rates) < k:
        raise ProfileError(f"profile {path}: {len(rates)} draft positions measured, num_speculative_tokens={k}; use "
                           f"num_speculative_tokens <= {len(rates)} (a profile says nothing of positions it did not "
                           "measure)")
    return rates[:k]


def forced_acceptance(profile: dict, k: int | None = None) -> dict[str, list[str] | dict]:
    """The settings that force a profile's acceptance on each engine, in its own syntax. Every
    specsweep engine that runs method=synthetic writes its own (its adapter's engine_config, the
    same mapping its runs use: vLLM's rejection_sample_method "synthetic" with
    synthetic_acceptance_rates, llama-server's --spec-synth-rates); for the engines without a
    synthetic method here, their documented forcing knobs:
    - SGLang: the environment variable SGLANG_SIMULATE_ACC_LEN, a mean accept length;
    - TensorRT-LLM: TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS, accepted draft tokens per step (the
      mean accept length minus the bonus token, rounded: it forces one number, not a distribution).
    k (default: the profile's own) cuts the rates to that draft length."""
    from hydra.utils import get_class

    import backends
    from .method_settings import Synthetic

    rates = [float(x) for x in profile["marginal_accept_rates"]]
    k = len(rates) if k is None else k
    method = {**vars(Synthetic()), "acceptance_rates": rates[:k]}
    out: dict[str, list[str] | dict] = {}
    for path in backends.CONFIGS:
        node = get_class(path)
        cls = get_class(node._target_)
        if method["name"] in cls.supported_methods:
            out[node.name] = cls.engine_config(method, k)
    tau = 1 + sum(rates[:k])
    out["sglang (environment)"] = {"SGLANG_SIMULATE_ACC_LEN": f"{tau:.4g}"}
    out["tensorrt_llm (environment)"] = {"TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS": str(max(0, min(k, round(tau - 1))))}
    return out


def by_category_markdown(sweep_dir: Path, df: pd.DataFrame) -> list[str]:
    """The report's acceptance-by-category matrix: for a sweep with a categorized workload (a
    job's profile with two categories or more: Spec-Bench's question.jsonl, SPEED-Bench), the mean
    accept length per category (rows) and per engine, method and draft length (columns), from
    each job's speculation_profile.json (the smallest batch where a job ran at several)."""
    if df.empty or "job" not in df.columns:
        return []
    cols: dict[str, dict[str, float]] = {}
    ok = df[(df.status == "ok")] if "status" in df.columns else df
    for _, r in ok.sort_values("batch_size").iterrows():
        f = Path(sweep_dir) / str(r.job) / FILENAME
        if not f.exists():
            continue
        cats = (json.loads(f.read_text()).get("per_category") or {})
        label = f"{r.backend}/{r.method} k={r.num_speculative_tokens} T={r.temperature:g} ({r.workload})"
        if len(cats) >= 2 and label not in cols:
            cols[label] = cats
    if not cols:
        return []
    cats = sorted({c for v in cols.values() for c in v})
    out = ["## Acceptance by category", "",
           "Mean accept length (1 + accepted tokens / steps, the bonus token included) of each prompt category, "
           "per job (its speculation_profile.json; at its smallest batch).", "",
           "| category | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for c in cats:
        out.append(f"| {c} | " + " | ".join(f"{v[c]:.2f}" if c in v else "-" for v in cols.values()) + " |")
    return out + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specsweep-profile", description=(
        "Check a speculation_profile.json (specsweep's, or Model-Optimizer specdec_bench's schema 1.0) and print "
        "the settings that force its acceptance on vLLM, llama-server, SGLang and TensorRT-LLM; "
        "`specsweep method=synthetic method.profile_path=FILE` runs it on any specsweep engine."))
    ap.add_argument("profile", help="a speculation_profile.json (every specsweep job that drafted writes one)")
    ap.add_argument("--k", type=int, help="draft length to force (default: the profile's own)")
    a = ap.parse_args(argv)
    try:
        prof = read(a.profile)
        if a.k is not None:
            marginal_rates(a.profile, a.k)
            if a.k < 1:
                raise ProfileError(f"--k={a.k}: use 1 or more")
    except ProfileError as e:
        print(f"specsweep-profile: {e}", file=sys.stderr)
        return 2
    checks = validation([float(x) for x in prof["marginal_accept_rates"]], prof.get("mean_accept_length"))
    print(json.dumps({"marginal_accept_rates": prof["marginal_accept_rates"],
                      "mean_accept_length": prof.get("mean_accept_length"), "validation": checks,
                      "forced_acceptance": forced_acceptance(prof, a.k)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
