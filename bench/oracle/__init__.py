"""Oracle analysis: replay per-position acceptance traces under a cost model.

A trace gives, for a request and each method m, acc_len_m[i]: how many tokens a cycle starting at
generated position i would emit under m (accepted + 1). A policy walks each request: at position
i it proposes `input_len` tokens to verify (drafts + 1), emits min(acc_len, input_len), and moves
on; the cost model (bench/costmodel.py) times every cycle's verify and drafting.

Policies (policies.py, adaptive.py, dp.py; one class each, POLICIES maps a spec's kind to its class):
- fixed:M:K, oracle:M, combined:M+N[+...], fallback:CHEAP+NEURAL:K (realizable) and
  randmatch:M:K[:P] (the published random n-gram match model);
- realizable adaptive rules (adaptive.py; they see only the past: tokens so far, their own cycles'
  outcomes, a lookup's proposal length at the current position where the trace records draft_len):
  match:CHEAP+NEURAL:M:KC:KN  the lookup at min(its proposal, KC) where it proposes >= M tokens,
                              else the neural drafter at KN (n/a on traces without the lookup's draft_len);
  tree:CHEAP+NEURAL:M:KC:KN   both drafts as two branches of one verify (the longer accepted kept) where
                              the lookup proposes with a match shorter than M and no copy is under way,
                              else the lookup alone (or, without a proposal, the neural drafter alone);
                              needs draft_len and match_len; simulator only (lanes.outcome);
  ema:METHOD:K0[:ALPHA[:KMAX]]  k = clip(floor(e + 1/2), 1, KMAX), e an EMA (weight ALPHA, default
                              0.5; KMAX 8) of accepted drafts, +1 when a cycle accepted them all;
  goodput:M1+M2[+...]:KMAX    per cycle the (method, k in 0..KMAX) with the most expected tokens per
                              second, from per-depth acceptance estimates (Beta(1, 1) prior) of its own cycles;
  ucb:M1+M2[+...]:K1,K2,...   UCB1 over (method, k) arms, reward = speedup of the cycle over a plain step / (max k + 1);
  schedule:METHOD:B1=K1,...   k by batch size (an engine's static schedule);
  conf:[CHEAP+]NEURAL[:M:KC]:KMAX:THR  a confidence threshold (DISCO / SpecDec++ style): the neural
                              drafter's drafts while their probability under it is >= THR, up to KMAX
                              (the first one below: SD skipped for the cycle), after the lookup (k <= KC)
                              where its match length is >= M; n/a on traces without draft_prob;
- dp:M1[+M2...]:KMAX: the clairvoyant per-cycle bound (dynamic programming over positions; exact at
  batch 1, approximate above: column approximate).
Accountings optimistic and faithful; columns realizable and gap_closed = (policy - best fixed) /
(dp - best fixed) per dataset, batch size and accounting; `--tune` cross-fits match's M, KN, ema's
ALPHA, KMAX (and tree's, conf's) on each half of the requests (tune_split, seed TUNE_SEED) and scores
the other (half = first, second; both: every request, each under the fit of the other half);
a neural draft is charged per cycle or per head step (DraftCost.per, --neural-draft-charge).

The package:
- tracefile.py  Trace, TraceError, load_traces: the interchange format, read and checked (acc_len, and
                where recorded draft_len, match_len, draft_prob); recompute_lookup, parse_lookup: a
                lookup's draft_len and match_len recomputed from token ids (--lookup-from-tokens),
                or a lookup variant replayed as a method of its own (NAME=METHOD:...);
- policies.py   Policy, Context, the published policies, POLICIES, Policy.parse, default_policies;
- adaptive.py   the realizable adaptive policies; dp.py the dp bound;
- lanes.py      Lanes (requests x contexts replayed together as arrays), walk_stateless, walk_lockstep;
- simulate.py   trajectories (every request at once), trajectory (one), request_times, simulate (repeat
                batches, as published),
                simulate_randmatch, simulate_set (batches of different requests), run (the table),
                tune_split, combine (results of disjoint requests together), add_gap_closed;
- reporting.py  summary_markdown, plot;
- cli.py        main: specsweep-oracle, also python -m bench.oracle.
"""
from .policies import POLICIES, Combined, Context, Fallback, FixedK, OracleK, Policy, PolicyError, RandMatch, default_policies
from .adaptive import Confidence, Ema, Goodput, Match, Schedule, Tree, Ucb  # noqa: I001 (after policies: they join POLICIES)
from .dp import Dp

POLICIES["randmatch"] = POLICIES.pop("randmatch")  # the published n-gram model last, as errors have listed it
from .cli import main
from .reporting import plot, summary_markdown
from .simulate import (PUBLISHED_MATCH_PROB, SAMPLE_SEED, TUNE_SEED, Trajectory, add_gap_closed, request_times, run,
                       sample_requests, simulate, simulate_randmatch, simulate_set, trajectories, trajectory, tune_split)
from .tracefile import Trace, TraceError, generated_len, load_traces

__all__ = ["Combined", "Confidence", "Context", "Dp", "Ema", "Fallback", "FixedK", "Goodput", "Match", "OracleK", "POLICIES",
           "PUBLISHED_MATCH_PROB", "Policy", "PolicyError", "RandMatch", "SAMPLE_SEED", "Schedule", "TUNE_SEED", "Trace",
           "TraceError", "Trajectory", "Ucb", "add_gap_closed", "default_policies", "generated_len", "load_traces", "main",
           "plot", "request_times", "run", "sample_requests", "simulate", "simulate_randmatch", "simulate_set",
           "summary_markdown", "trajectories", "trajectory", "tune_split"]
