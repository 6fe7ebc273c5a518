"""`specsweep-versus JOB_A JOB_B`: two methods' jobs on the same requests, head to head.

Each job measured its method paired against its own baseline; the two jobs ran the same
requests (same workload, prompts, batch size, sampling and seed). This prints A's speedup over
B (A's paired speedup / B's) with a 95% interval from a bootstrap that resamples the batches
jointly for both jobs (bench.metrics.versus): a prompt on which every method does well lifts
both speedups alike and cancels, so the comparison is as sharp as the methods' difference on
each request, where two separate speedup intervals carry the spread between prompts twice.

Exit status: 0 with the comparison printed, 2 when the jobs did not run the same requests (it
says which setting differs) or a folder is not a completed job.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from .metrics import versus
from .metrics.job import pair_strata

# What makes two jobs' requests the same: a job's settings besides its method and draft length.
SAME_REQUESTS = ("model.name", "workload.name", "batch_size", "temperature", "top_p", "top_k", "max_new_tokens",
                 "num_prompts", "seed")


def batches(job_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A job's measured batches, baseline and method side by side: (repeat, batch, tokens_spec,
    wall_s_spec, tokens_base, wall_s_base, requests), from its requests.parquet. A batch's wall
    time is its last request's end (e2e from the batch's start), which gives the summary's paired
    speedup (to three decimals on the runs checked); and the requests themselves."""
    req = pd.read_parquet(job_dir / "requests.parquet")
    req = req.assign(n=req.output_token_ids.map(len))
    g = req.groupby(["run", "repeat", "batch"]).agg(tokens=("n", "sum"), wall_s=("e2e_s", "max"),
                                                    requests=("request_id", lambda x: tuple(sorted(x))))
    g = g.reset_index()
    spec, base = g[g.run == "spec"], g[g.run == "baseline"]
    both = spec.merge(base, on=["repeat", "batch", "requests"], suffixes=("_spec", "_base"))
    return both.drop(columns=["run_spec", "run_base"]).sort_values(["repeat", "batch"]), req


def compare(job_a: Path, job_b: Path) -> dict:
    """The comparison of two completed jobs (ValueError naming what keeps them apart)."""
    cfgs = []
    for job in (job_a, job_b):
        if not (job / "config.yaml").exists() or not (job / "requests.parquet").exists():
            raise ValueError(f"{job} is not a completed job folder (needs config.yaml and requests.parquet)")
        cfgs.append(OmegaConf.load(job / "config.yaml"))
    a_b = [(k, OmegaConf.select(cfgs[0], k), OmegaConf.select(cfgs[1], k)) for k in SAME_REQUESTS]
    differ = [f"{k}: {x!r} against {y!r}" for k, x, y in a_b if x != y]
    if differ:
        raise ValueError("the two jobs did not run the same requests (" + "; ".join(differ) + ")")
    (a, req_a), (b, _) = batches(job_a), batches(job_b)
    shared = a.merge(b, on=["repeat", "batch", "requests"], suffixes=("_a", "_b"))
    if not len(shared):
        raise ValueError(f"{job_a.name} and {job_b.name} share no measured batch of the same requests")
    pick = lambda s: shared.rename(columns=lambda c: c[: -len(s)] if c.endswith(s) else c)  # noqa: E731
    strata = pair_strata(shared, req_a[req_a.run == "spec"])
    got = versus(pick("_a"), pick("_b"), seed=int(cfgs[0].seed), strata=strata)
    got.update(method_a=str(cfgs[0].method.name), method_b=str(cfgs[1].method.name))
    return got


def line(got: dict, job_a: Path, job_b: Path) -> str:
    return (f"{got['method_a']} ({job_a.name}) against {got['method_b']} ({job_b.name}) on the same "
            f"{got['pairs']} batches: {got['ratio']:.3f}x [{got['ratio_ci_low']:.3f}, {got['ratio_ci_high']:.3f}] "
            f"(their paired speedups over those batches: {got['speedup_a']:.3f} and {got['speedup_b']:.3f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specsweep-versus", description=__doc__.split("\n\n")[0],
                                 epilog="Exit status: 0 compared, 2 not the same requests or not a job folder.")
    ap.add_argument("job_a", type=Path, help="a job folder: results/<sweep>/<job>")
    ap.add_argument("job_b", type=Path, help="another job folder, same requests")
    a = ap.parse_args(argv)
    try:
        got = compare(a.job_a, a.job_b)
    except ValueError as e:
        print(f"specsweep-versus: {e}", file=sys.stderr)
        return 2
    print(line(got, a.job_a, a.job_b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
