"""Oracle analysis: replay per-position acceptance traces under a cost model.

A trace gives, for a request and each method m, acc_len_m[i]: how many tokens a cycle starting at
generated position i would emit under m (accepted + 1). A policy walks each request: at position
i it proposes `input_len` tokens to verify (drafts + 1), emits min(acc_len, input_len), and moves
on; the cost model (bench/costmodel.py) times every cycle's verify and drafting.

Policies (policies.py, one class each, POLICIES maps a spec's kind to its class):
fixed:M:K, oracle:M, combined:M+N[+...], fallback:CHEAP+NEURAL:K (realizable) and
randmatch:M:K[:P] (the published random n-gram match model); optimistic and faithful accounting.

The package:
- tracefile.py  Trace, TraceError, load_traces: the interchange format, read and checked;
- policies.py   Policy, its subclasses, POLICIES, Policy.parse, default_policies;
- simulate.py   trajectory, request_times, simulate (repeat batches, as published),
                simulate_randmatch, simulate_set (batches of different requests), run (the table);
- reporting.py  summary_markdown, plot;
- cli.py        main: specsweep-oracle, also python -m bench.oracle.
"""
from .cli import main
from .policies import POLICIES, Combined, Fallback, FixedK, OracleK, Policy, PolicyError, RandMatch, default_policies
from .reporting import plot, summary_markdown
from .simulate import (PUBLISHED_MATCH_PROB, SAMPLE_SEED, Trajectory, request_times, run, sample_requests, simulate,
                       simulate_randmatch, simulate_set, trajectory)
from .tracefile import Trace, TraceError, generated_len, load_traces

__all__ = ["Combined", "Fallback", "FixedK", "OracleK", "POLICIES", "PUBLISHED_MATCH_PROB", "Policy", "PolicyError",
           "RandMatch", "SAMPLE_SEED", "Trace", "TraceError", "Trajectory", "default_policies", "generated_len",
           "load_traces", "main", "plot", "request_times", "run", "sample_requests", "simulate", "simulate_randmatch",
           "simulate_set", "summary_markdown", "trajectory"]
