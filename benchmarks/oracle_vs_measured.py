"""Simulated vs measured speedup for the jobs of a sweep (batch size 1, greedy).

  python benchmarks/oracle_vs_measured.py results/default

For each batch-1 job: acceptance traces from its own baseline generations (specsweep-trace), a
cost model fitted on the sweep's measured cycles and TTFTs (specsweep-fit-cost), then the
simulator's fixed-k policy for the job's method (a method=adaptive job: its own policy,
method.policy, over the methods it names, faithful accounting), against the job's measured
speedup. All of the job's requests are simulated (no sampling), and the speedup is total tokens
over total time in both (the simulator's set batches of one request)."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omegaconf import OmegaConf  # noqa: E402

from bench.costmodel import cost_model_from_dict  # noqa: E402
from bench.fitcost import fit_sweep  # noqa: E402
from bench.oracle import FixedK, Policy, load_traces, simulate_set  # noqa: E402
from bench.results import load_summaries  # noqa: E402
from bench.traces import build_traces  # noqa: E402


def main(sweep: str) -> None:
    sweep_dir = Path(sweep)
    cost = cost_model_from_dict(fit_sweep(sweep_dir, "fitted"))
    tmp = Path(tempfile.mkdtemp())
    df = load_summaries(sweep_dir)
    rows = []
    for _, s in df[(df.status == "ok") & (df.batch_size == 1) & (df.temperature == 0)].iterrows():
        if s.method == "autoregressive":
            continue
        policy, accounting = FixedK((s.method,), int(s.num_speculative_tokens)), "optimistic"
        m = OmegaConf.load(sweep_dir / s.job / "config.yaml").method
        if m.get("policy"):  # a policy the engine ran (method=adaptive), replayed over its methods' traces
            policy, accounting = Policy.parse(m.policy), m.get("accounting", "faithful")
        traces, _ = build_traces(sweep_dir / s.job, list(policy.methods))
        f = tmp / f"{s.job}.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in traces))
        # set batches of 1: total tokens over total time, as the measured speedup is (metrics.paired_speedup)
        sim = simulate_set(load_traces(f), policy, cost, [1], accounting, n_requests=len(traces))["speedup"][0]
        rows.append((s.method, s.workload, s.speedup, s.speedup_ci_low, s.speedup_ci_high, sim))
        print(f"{s.method:12s} {s.workload:10s} measured {s.speedup:.2f} [{s.speedup_ci_low:.2f}, {s.speedup_ci_high:.2f}]"
              f"  simulated {sim:.2f}  ({100 * (sim / s.speedup - 1):+.0f}%)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results/default")
