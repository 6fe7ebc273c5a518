"""specsweep's oracle simulator against the published one, same machine, same traces.

  python benchmarks/oracle_speed.py TRACES_DIR [--published-simulator DIR]

TRACES_DIR holds the published combined_<dataset>.jsonl files (SpecDecode-Bench, Llama-3.1-8B;
they carry no license, so they are not part of this repository, and this check is not a test).
With --published-simulator (a checkout of SpecDecode-Bench's simulator) its
`main.py --proposer combined` is timed on one dataset, and every row of every
<proposer>_<dataset>_speedup.csv in its results/ folder is compared with specsweep's, number for
number; any difference exits with status 1."""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.costmodel import LLAMA31_8B_H100  # noqa: E402
from bench.oracle import Policy, load_traces, run, simulate  # noqa: E402

BATCHES = [1, 8, 16, 32, 64, 128]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces_dir")
    ap.add_argument("--published-simulator")
    ap.add_argument("--dataset", default="instructcoder")
    a = ap.parse_args()
    files = sorted(Path(a.traces_dir).glob("combined_*.jsonl"))
    t = time.perf_counter()
    traces = load_traces(Path(a.traces_dir) / f"combined_{a.dataset}.jsonl")
    ours = simulate(traces, Policy.parse("combined:ngram+eagle"), LLAMA31_8B_H100, BATCHES)["speedup"]
    t_one = time.perf_counter() - t
    print(f"specsweep, {a.dataset}, combined, batch {BATCHES}: {t_one:.2f} s -> {[round(x, 2) for x in ours]}")
    batches = [1, 2, 4, 8, 16, 32, 64, 128]
    for mode in ("repeat", "set"):
        t = time.perf_counter()
        df = run([str(f) for f in files], LLAMA31_8B_H100, batches, ["optimistic", "faithful"], batch_mode=mode)
        print(f"specsweep, {len(files)} datasets x {df.policy.nunique()} policies x 2 accountings x batch {batches} "
              f"({mode} batches): {time.perf_counter() - t:.2f} s, {len(df)} rows")
    if a.published_simulator:
        out = Path(tempfile.mkdtemp())
        t = time.perf_counter()
        subprocess.run([sys.executable, "main.py", "--proposer", "combined", "--datasets", a.dataset, "--output-dir",
                        str(out)], cwd=a.published_simulator, check=True, capture_output=True)
        t_pub = time.perf_counter() - t
        theirs = pd.read_csv(out / f"combined_{a.dataset}_speedup.csv")
        same = [round(x, 2) for x in ours] == theirs.speedup.round(2).tolist()
        print(f"published simulator, same job: {t_pub:.1f} s -> {theirs.speedup.tolist()}; identical to 2 decimals: {same}; "
              f"specsweep is {t_pub / t_one:.0f}x faster")
        total, diffs = compare_published(Path(a.published_simulator) / "results", Path(a.traces_dir))
        print(f"published result rows compared: {total}, differences: {diffs}")
        if diffs or not same:
            sys.exit(1)


def compare_published(results_dir: Path, traces_dir: Path) -> tuple[int, int]:
    """Every row the published simulator wrote (batch_size, predict_method, acc_method, speedup)
    against the same policy here: FIXED_k / ORACLE on EAGLE or NGRAM, and the combined oracle."""
    total = diffs = 0
    for f in sorted(results_dir.glob("*_speedup.csv")):
        dataset = f.stem.split("_")[1]
        traces = load_traces(traces_dir / f"combined_{dataset}.jsonl")
        ref = pd.read_csv(f)
        for (pm, acc), g in ref.groupby(["predict_method", "acc_method"]):
            m = "ngram" if acc == "NGRAM" else "eagle"
            if acc.startswith("COMBINE"):
                pol = "combined:ngram+eagle"
            elif pm == "ORACLE":
                pol = f"oracle:{m}"
            else:
                pol = f"randmatch:ngram:{pm[-1]}" if m == "ngram" else f"fixed:eagle:{pm[-1]}"
            got = simulate(traces, Policy.parse(pol), LLAMA31_8B_H100, g.batch_size.tolist(), dataset=dataset)["speedup"]
            for b, want, x in zip(g.batch_size, g.speedup, got):
                total += 1
                if round(x, 2) != want:
                    diffs += 1
                    print(f"  differs: {dataset} {pol} batch {b}: published {want}, specsweep {x:.4f}")
    return total, diffs


if __name__ == "__main__":
    main()
