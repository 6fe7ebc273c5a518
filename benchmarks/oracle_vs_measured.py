"""Simulated vs measured speedup for the jobs of a sweep (batch size 1, greedy).

  python benchmarks/oracle_vs_measured.py results/default

For each batch-1 job: acceptance traces from its own baseline generations (specsweep-trace), a
cost model fitted on the sweep's measured cycles and TTFTs (specsweep-fit-cost), then the
simulator's fixed-k policy for the job's method, against the job's measured speedup. All of the
job's requests are simulated (no sampling)."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.costmodel import cost_model_from_dict  # noqa: E402
from bench.fitcost import fit_sweep  # noqa: E402
from bench.oracle import FixedK, load_traces, simulate  # noqa: E402
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
        traces, _ = build_traces(sweep_dir / s.job, [s.method])
        f = tmp / f"{s.job}.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in traces))
        sim = simulate(load_traces(f), FixedK((s.method,), int(s.num_speculative_tokens)), cost, [1],
                       n_requests=len(traces))["speedup"][0]
        rows.append((s.method, s.workload, s.speedup, s.speedup_ci_low, s.speedup_ci_high, sim))
        print(f"{s.method:12s} {s.workload:10s} measured {s.speedup:.2f} [{s.speedup_ci_low:.2f}, {s.speedup_ci_high:.2f}]"
              f"  simulated {sim:.2f}  ({100 * (sim / s.speedup - 1):+.0f}%)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results/default")
