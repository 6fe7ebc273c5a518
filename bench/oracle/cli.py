"""specsweep-oracle (python -m bench.oracle): trace files in, a table, a summary and a plot out."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ..costmodel import load_cost_model, with_neural_charge
from ..methods import declare
from .reporting import plot, summary_markdown
from .simulate import run
from .tracefile import TraceError, parse_lookup


def _load_plotting() -> None:
    """The table's and the plot's libraries (pandas and matplotlib, close to a second on a slow
    CPU), loaded while the last trace files are simulated on a CPU left free, rather than before
    or after them."""
    import pandas  # noqa: F401

    from .. import plotting  # noqa: F401  (matplotlib)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specsweep-oracle", description="Replay acceptance traces under a cost model: "
                                 "fixed-k, oracle-k, combined and realizable policies, optimistic and faithful accounting.")
    ap.add_argument("traces", nargs="+", help="trace files (JSONL, interchange format; published traces load as they are)")
    ap.add_argument("--cost-model", default="llama3.1-8b-h100", help="a named model (llama3.1-8b-h100) or a YAML file")
    ap.add_argument("--accounting", choices=["optimistic", "faithful", "both"], default="both")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    ap.add_argument("--policies", nargs="+", help="e.g. fixed:eagle:3 oracle:ngram combined:ngram+eagle "
                    "fallback:ngram+eagle:3 randmatch:ngram:3 match:ngram+eagle:1:8:3 ema:eagle:3[:ALPHA[:KMAX]] "
                    "goodput:ngram+eagle:8 ucb:ngram+eagle:1,3,5 schedule:eagle:1=5,32=3 conf:eagle:4:0.3 "
                    "conf:ngram+eagle:1:8:4:0.3 dp:ngram+eagle:8 (default: "
                    "fixed k=1,3,5 and oracle per method, combined, fallback; with --batch-mode repeat on a published "
                    "dataset also randmatch k=1,3,5; then ema:M:3 per method, goodput, ucb, match where the traces "
                    "have draft_len, conf where they have draft_prob (alone and after the lookup), and dp)")
    ap.add_argument("--requests", type=int, default=300, help="requests sampled per dataset (seed 42; published: 300)")
    ap.add_argument("--batch-mode", choices=["set", "repeat"], default="set",
                    help="set: B different requests per batch (default); repeat: one request repeated B times, the "
                         "published methodology (use it to reproduce published numbers)")
    ap.add_argument("--drafter-kind", nargs="+", default=[], metavar="NAME=KIND",
                    help="the drafter kind of a trace's method that is not one of specsweep's (e.g. medusa=head); "
                         "kinds: none, lookup, model, head, layers, mixed (bench/methods.py)")
    ap.add_argument("--neural-draft-charge", choices=["cycle", "step", "both"],
                    help="charge a neural draft once per cycle (the published constants) or per head step (k "
                         "sequential forwards); both: report each (default: as the cost model says, cycle unless its "
                         "YAML sets per: step)")
    ap.add_argument("--tune", action="store_true",
                    help="cross-fit the parameters of match, tree, ema and conf: the sampled requests in two halves (a "
                         "fixed seeded split), each policy fitted on one half and scored on the other, both ways; rows "
                         "per half scored (column half = first, second) and for every request (half = both)")
    ap.add_argument("--lookup-from-tokens", nargs="+", default=[],
                    metavar="[NAME=]METHOD[:MIN:MAX:K[:earliest|latest]]",
                    help="recompute METHOD's lookup (its draft_len and match_len) from the traces' token ids where they "
                         "record no match_len: bench/ngram.py's prompt lookup over prompt + generated tokens, match "
                         "lengths MIN..MAX, up to K tokens (default 3:7:20:earliest, which reproduces the published "
                         "traces' n-gram); how often it agrees with the trace's acc_len is printed. NAME=: the lookup "
                         "becomes a method of that name beside METHOD, its acc_len too from the token ids (a lookup "
                         "variant on traces that recorded another; e.g. ngram17=ngram:1:7:20:latest)")
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                    help="trace files simulated at once, each in a process of its own (default: the CPUs this process "
                         "may use; 1: one after another in this process); the results are the same")
    ap.add_argument("--out", default="oracle_results", help="output folder")
    return ap


def main(argv=None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    if a.jobs < 1:
        print(f"specsweep-oracle: --jobs must be at least 1, got {a.jobs}", file=sys.stderr)
        return 2
    if any(b < 1 for b in a.batch_sizes):
        print(f"specsweep-oracle: --batch-sizes must be positive, got {a.batch_sizes}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        declare(a.drafter_kind)
        lookups = [parse_lookup(x) for x in a.lookup_from_tokens]
        cost = load_cost_model(a.cost_model)
        accountings = ["optimistic", "faithful"] if a.accounting == "both" else [a.accounting]
        charges = {None: [None], "both": ["cycle", "step"]}.get(a.neural_draft_charge, [a.neural_draft_charge])
        tables = [run(a.traces, cost if per is None else with_neural_charge(cost, per), a.batch_sizes, accountings,
                      a.policies, a.requests, a.batch_mode, a.tune,
                      warn=lambda m: print(f"specsweep-oracle: {m}", file=sys.stderr), lookups=lookups,
                      jobs=a.jobs, while_waiting=_load_plotting)
                  for per in charges]
    except (TraceError, ValueError) as e:
        print(f"specsweep-oracle: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    import pandas as pd  # loaded by now (run, _load_plotting)

    df = pd.concat(tables, ignore_index=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out / "oracle.parquet", index=False)
    df.to_csv(out / "oracle.csv", index=False)
    md = summary_markdown(df, cost)
    (out / "summary.md").write_text(md)
    plot(df, out)
    print(md)
    print(f"{len(df)} rows in {elapsed:.2f} s -> {out}/oracle.parquet, oracle.csv, summary.md, oracle_speedup.png")
    return 0
