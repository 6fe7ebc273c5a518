"""Simulators: a policy's trajectory over a trace, and its timing under a cost model.

A policy walks each request: at generated position i it proposes `input_len` tokens to verify
(drafts + 1), emits min(acc_len, input_len), and moves on (trajectory). Timing follows
SpecDecode-Bench's methodology: prefill counted, per-step overhead, target forward =
CostModel.verify(kv, batched_tokens).

- simulate: `repeat` batches, one request repeated B times (as published); speedup = mean
  speculative throughput / mean baseline throughput over the sampled requests. The trajectory of a
  request under a deterministic policy does not depend on B, so it is computed once and the time of
  every batch size follows in closed form (numpy; request_times).
- simulate_randmatch: the published random n-gram match model, under simulate.
- simulate_set: batches of B different requests, as a server sees them.
- run: every policy x accounting x batch size for trace files, as a table.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from .. import metrics
from ..costmodel import CostModel
from ..methods import declare, is_lookup
from .lanes import Lanes, positions_within, walk_lockstep, walk_stateless
from .policies import Context, Policy, RandMatch, default_policies
from .tracefile import Trace, generated_len, load_traces, recompute_lookup

SAMPLE_SEED = 42  # the published methodology samples 300 requests with random.seed(42)

# The published simulator's n-gram match model for fixed k: where acc_len is 1, each copy of the
# request finds a match with this probability (else it proposes nothing), by dataset.
PUBLISHED_MATCH_PROB = {"sharegpt": 0.2, "cnn": 0.4, "gsm8k": 0.2, "instructcoder": 0.8}


@dataclass
class Trajectory:
    input_len: np.ndarray  # per cycle: tokens verified (drafts + 1)
    emitted: np.ndarray  # per cycle: tokens emitted (accepted drafts + 1)
    ran: np.ndarray  # per cycle x method: did that drafter run (bool)
    winner: np.ndarray  # per cycle: index of the method whose proposal was used


def trajectories(traces: list[Trace], pol: Policy, ctxs=(None,)) -> list[list[Trajectory]]:
    """The cycles of policy pol over every request of traces, under each Context of ctxs (cost
    model, batch size, accounting: a batch-aware policy's choices depend on them; None for the
    others): per ctx, per request. Every replay runs at once, as lanes (lanes.py)."""
    lanes = Lanes(traces, ctxs, pol.methods)
    st = pol.start(lanes)
    lane, il, emitted, ran, w = (walk_stateless if pol.stateless else walk_lockstep)(pol, st, lanes)
    ends = np.cumsum(np.bincount(lane, minlength=len(lanes)))
    starts = np.concatenate(([0], ends[:-1]))
    out = [Trajectory(il[a:b], emitted[a:b], ran[a:b], w[a:b]) for a, b in zip(starts.tolist(), ends.tolist())]
    R = len(traces)
    return [out[c * R:(c + 1) * R] for c in range(len(ctxs))]


def trajectory(t: Trace, pol: Policy, ctx: Context | None = None) -> Trajectory:
    """The cycles of policy pol over request t; ctx (cost model, batch size, accounting) for the
    policies whose choices depend on them (batch_aware)."""
    return trajectories([t], pol, [ctx])[0][0]


def baseline_time(cost: CostModel, P, G, B):
    """Latency of a request decoded without speculation in a batch of B copies (arrays broadcast):
    prefill, then G - 1 decode steps while the KV grows by B per step. The steps' KV term is summed
    in closed form (an arithmetic series), the rest of each step is a verify of B tokens at no KV."""
    n = G - 1
    return (cost.prefill(B * P) + cost.overhead_per_step + n * (cost.verify(0, B) + cost.overhead_per_step)
            + cost.c_kv * B * (n * (P + 1) + n * (n - 1) / 2))


def _forwards(trajs) -> tuple[float, tuple[float, float]]:
    """tokens_per_forward of the trajectories, and its parts (tokens emitted, target forwards),
    which add up over disjoint requests (combine)."""
    # every simulated cycle is one target forward, whether it drafted or not: tokens per forward
    # (bench.metrics' definition), which the first versions of this table called mean_acceptance_length
    emitted = np.concatenate([t.emitted for t in trajs]) if trajs else np.zeros(0)
    return metrics.tokens_per_forward(emitted), (float(emitted.sum()), float(len(emitted)))


def _result(batch_sizes, speedups, parts, trajs, n_requests: int, per_batch_trajs=None) -> dict:
    """A simulator's answer. parts: per batch size, (numerator, denominator) of its speedup, each a
    sum over the requests, so that the results of disjoint sets of requests add up (combine);
    forward_parts likewise (tokens emitted, target forwards) for tokens_per_forward."""
    tpf, fw = _forwards(trajs)
    out = {"batch_sizes": list(batch_sizes), "speedup": list(speedups), "parts": [tuple(map(float, p)) for p in parts],
           "tokens_per_forward": tpf, "forward_parts": [fw] * len(batch_sizes), "requests": n_requests}
    if per_batch_trajs is not None:  # a batch-aware policy: a trajectory per batch size
        by_batch = [_forwards(tr) for tr in per_batch_trajs]
        out["tokens_per_forward_by_batch"] = [t for t, _ in by_batch]
        out["forward_parts"] = [f for _, f in by_batch]
    return out


def combine(results: list[dict]) -> dict:
    """One result from the results of disjoint sets of requests, each for the same batch sizes:
    the speedup and tokens per forward of all of them together (sums of their parts)."""
    n = len(results[0]["batch_sizes"])
    parts = [tuple(sum(r["parts"][j][i] for r in results) for i in (0, 1)) for j in range(n)]
    fw = [tuple(sum(r["forward_parts"][j][i] for r in results) for i in (0, 1)) for j in range(n)]
    # tokens per forward as bench.metrics defines it (tokens emitted / forwards), from the summed parts
    return {"batch_sizes": list(results[0]["batch_sizes"]), "speedup": [a / b for a, b in parts], "parts": parts,
            "forward_parts": fw, "tokens_per_forward_by_batch": [e / c if c else float("nan") for e, c in fw],
            "tokens_per_forward": fw[0][0] / fw[0][1] if fw and fw[0][1] else float("nan"),
            "requests": sum(r["requests"] for r in results)}


def missed_tokens(emitted: np.ndarray, ran: np.ndarray, prompt_len: int = 0) -> np.ndarray:
    """Per cycle and method ([cycles, W]), what that method's drafter feeds before drafting if it
    runs now (DraftCost's c_missed): the tokens emitted since it last ran, and where it has not
    run yet in the request, the prompt and every token so far (the native engine prefills a draft
    model when a policy first picks it). A drafter that runs from the first cycle on, every cycle,
    feeds the prompt once at cycle 0 (c_missed is fitted only where drafters sit out cycles)."""
    C, W = ran.shape
    before = np.concatenate(([0], np.cumsum(emitted)))  # tokens emitted before cycle c
    out = np.zeros((C, W), dtype=np.float64)
    for j in range(W):
        ends = np.where(ran[:, j], np.arange(1, C + 1), 0)  # the cycle after each run of j
        last = np.concatenate(([0], np.maximum.accumulate(ends)[:-1])) if C else ends
        out[:, j] = np.where(last > 0, before[:C] - before[last], prompt_len + before[:C])
    return out


def _charges_catch_up(cost: CostModel, pol: Policy) -> bool:
    """Whether any of the policy's drafters has a catch-up cost (c_missed): only then is what each
    cycle's drafters missed worth counting (the published constants have none)."""
    return any(cost.draft(m).c_missed for m in pol.methods)


def request_times(t: Trace, pol: Policy, traj: Trajectory, cost: CostModel, B: np.ndarray, accounting: str):
    """Baseline and speculative latency of one request, batched as B copies of itself, for every
    batch size in B at once. Returns (baseline_latency[nB], spec_latency[nB], generated_len)."""
    P = t.prompt_len
    G = generated_len(t, pol.methods)
    Bf = B.astype(np.float64)
    prefill = cost.prefill(Bf * P)
    base = baseline_time(cost, P, G, Bf)
    # Speculative: per cycle, verify over B * input_len tokens at the KV before the cycle.
    emitted, il = traj.emitted.astype(np.float64), traj.input_len.astype(np.float64)
    cum_before = np.concatenate(([0.0], np.cumsum(emitted)[:-1]))
    kv_before = Bf[None, :] * (P + 1 + cum_before[:, None])  # [cycles, nB]
    verify = cost.verify(kv_before, Bf[None, :] * il[:, None])
    # The published simulator updates the KV count request by request inside a cycle, so copy i of
    # the batch drafts at kv_before + i * delta; the mean over copies is (B - 1) / 2 * delta.
    delta = emitted.copy()
    if len(delta):
        delta[-1] -= (1 + emitted.sum()) + P  # the last cycle also frees the request's KV
    kv_mean = kv_before + (Bf[None, :] - 1) / 2 * delta[:, None]
    missed = missed_tokens(traj.emitted, traj.ran, P)[:, None, :] if _charges_catch_up(cost, pol) else None
    draft = pol.draft_time(cost, accounting, traj.ran[:, None, :], verify, kv_mean, il[:, None], missed)
    step = verify + draft + cost.overhead_per_step
    if pol.charges_switching(accounting) and len(traj.winner) > 1:
        switches = float((traj.winner[1:] != traj.winner[:-1]).sum())
        step_total = step.sum(axis=0) + switches * cost.switching_cost
    else:
        step_total = step.sum(axis=0)
    spec = prefill + cost.overhead_per_step + step_total
    return base, spec, G


def _check_methods(traces, pol: Policy) -> None:
    missing = [m for m in pol.methods if not any(m in t.acc for t in traces)]
    if missing:
        have = sorted({m for t in traces for m in t.acc})
        raise ValueError(f"policy {pol.name}: the traces have no method {missing}; they have {have}")


def sample_requests(traces: list[Trace], methods, n: int = 300, rng: random.Random | None = None) -> list[Trace]:
    """The published sampling: random.seed(42); random.sample(requests with output, k=300). Pass
    rng to keep drawing from the same stream afterwards."""
    usable = [t for t in traces if all(m in t.acc for m in methods) and generated_len(t, methods) > 0]
    rng = rng or random.Random(SAMPLE_SEED)
    return rng.sample(usable, k=min(n, len(usable)))


def simulate(traces: list[Trace], pol: Policy, cost: CostModel, batch_sizes, accounting: str = "optimistic",
             n_requests: int = 300, dataset: str | None = None) -> dict:
    """Speedup per batch size, `repeat` batches (one request repeated B times, as published)."""
    _check_methods(traces, pol)
    if not pol.replays_trace:
        return simulate_randmatch(traces, pol, cost, batch_sizes, n_requests, dataset)
    B = np.asarray(batch_sizes, dtype=np.int64)
    reqs = sample_requests(traces, pol.methods, n_requests)
    base_tpt = np.zeros(len(B))
    spec_tpt = np.zeros(len(B))
    # A batch-aware policy's trajectory depends on B: one per batch size; the others' once for all.
    cols = [slice(j, j + 1) for j in range(len(B))] if pol.batch_aware else [slice(None)]
    per_b = trajectories(reqs, pol, [Context(cost, int(b), accounting) for b in B] if pol.batch_aware else [None])
    for c, trajs in zip(cols, per_b):
        for t, traj in zip(reqs, trajs):
            base, spec, G = request_times(t, pol, traj, cost, B[c], accounting)
            base_tpt[c] += B[c] * G / base
            spec_tpt[c] += B[c] * G / spec
    speedup = spec_tpt / base_tpt  # ratio of mean throughputs (the means' 1/n cancels)
    return _result(B.tolist(), speedup.tolist(), zip(spec_tpt, base_tpt), per_b[0], len(reqs),
                   per_b if pol.batch_aware else None)


def simulate_randmatch(traces, pol: RandMatch, cost: CostModel, batch_sizes, n_requests: int = 300,
                       dataset: str | None = None) -> dict:
    """The published fixed-k n-gram model, reproduced number for number (repeat batches only).

    Where acc_len is 1 a copy drafts k tokens with probability p, else nothing; either way it
    emits one token, so the copies of a request stay in step and only the verified token count and
    the drafting charge vary. The draws are Python's random() stream after random.seed(42) and the
    300-request sample, consumed copy by copy as the published simulator does; numpy's MT19937
    replays that stream (same generator state, same 53-bit doubles), vectorized."""
    p = pol.match_prob if pol.match_prob is not None else PUBLISHED_MATCH_PROB.get(dataset or "")
    if p is None:
        raise ValueError(f"policy {pol.name}: no published match probability for dataset {dataset!r} "
                         f"({', '.join(PUBLISHED_MATCH_PROB)}); give one: randmatch:{pol.methods[0]}:{pol.k}:P")
    dc = cost.draft(pol.methods[0])
    rng = random.Random(SAMPLE_SEED)
    reqs = sample_requests(traces, pol.methods, n_requests, rng)
    version, state, _ = rng.getstate()
    mt = np.random.RandomState()
    mt.set_state(("MT19937", np.asarray(state[:-1], dtype=np.uint32), state[-1]))
    mt_state = mt.get_state()
    if dc.kind != "relative":
        raise ValueError(f"policy {pol.name}: the random match model is for n-gram (relative-cost) drafters")
    trajs = trajectories(reqs, pol)[0]
    # Every cycle of every request, concatenated in the order the published simulator visits them.
    befores = [np.cumsum(tr.emitted) - tr.emitted for tr in trajs]  # tokens before each cycle = its position
    emitted = np.concatenate([tr.emitted for tr in trajs] + [np.zeros(0)]).astype(float)
    req = np.concatenate([np.full(len(tr.emitted), i) for i, tr in enumerate(trajs)] + [np.zeros(0, int)])
    cum_before = np.concatenate(befores + [np.zeros(0)]).astype(float)
    one = np.concatenate([np.asarray(t.acc[pol.methods[0]])[b] == 1 for t, b in zip(reqs, befores)] + [np.zeros(0, bool)])
    P = np.array([t.prompt_len for t in reqs], float)
    G = np.array([generated_len(t, pol.methods) for t in reqs], float)
    n_one = int(one.sum())
    speedups, parts = [], []
    for B in batch_sizes:
        mt.set_state(mt_state)  # the published simulator reseeds before every batch size
        m = np.full(len(emitted), float(B))
        m[one] = (mt.random_sample(B * n_one) < p).reshape(-1, B).sum(1)  # copies with a match, per such cycle
        pre = cost.prefill(B * P) + cost.overhead_per_step
        base = baseline_time(cost, P, G, B)
        verify = cost.verify(B * (P[req] + 1 + cum_before), m * (pol.k + 1) + (B - m))
        step = verify + dc.fraction * verify * m / B + cost.overhead_per_step  # a copy without a match drafts nothing
        spec = pre + np.bincount(req, weights=step, minlength=len(reqs))
        parts.append(((B * G / spec).sum(), (B * G / base).sum()))
        speedups.append(float(parts[-1][0] / parts[-1][1]))
    return _result(batch_sizes, speedups, parts, trajs, len(reqs))


def simulate_set(traces: list[Trace], pol: Policy, cost: CostModel, batch_sizes, accounting: str = "optimistic",
                 n_requests: int = 300) -> dict:
    """Batches of B different requests (consecutive groups of the sampled requests), as a server
    sees them: rows leave when they finish, a step verifies every active row in one forward and
    waits for the slowest row's drafting. speedup = total speculative throughput / baseline's."""
    _check_methods(traces, pol)
    reqs = sample_requests(traces, pol.methods, n_requests)
    if not reqs:
        raise ValueError(f"policy {pol.name}: no request has a trace for every one of {list(pol.methods)}")
    ctxs = [Context(cost, int(B), accounting) for B in batch_sizes]
    trajs_by_b = trajectories(reqs, pol, ctxs) if pol.batch_aware else trajectories(reqs, pol) * len(batch_sizes)
    P = np.array([t.prompt_len for t in reqs], dtype=np.int64)
    G = np.array([generated_len(t, pol.methods) for t in reqs], dtype=np.int64)
    speedups, parts = [], []
    laid_out = None
    for j, (B, trajs) in enumerate(zip(batch_sizes, trajs_by_b)):
        if laid_out is None or trajs is not trajs_by_b[j - 1]:  # the same trajectories: laid out once
            laid_out = _cycles_laid_out(cost, pol, P, trajs)
        # consecutive groups of B; a partial tail batch would mix batch sizes (unless it is the only one)
        rows = len(reqs) if len(reqs) < B else len(reqs) // B * B
        tok, base_t, spec_t = _set_batches(cost, pol, accounting, P, G, laid_out, rows, int(B))
        speedups.append((tok / spec_t) / (tok / base_t))
        parts.append((base_t, spec_t))  # the same tokens in both: speedup = base_t / spec_t
    return _result(batch_sizes, speedups, parts, trajs_by_b[0] if trajs_by_b else [], len(reqs),
                   trajs_by_b if pol.batch_aware else None)


def _group_sums(values: np.ndarray, lengths: np.ndarray) -> list[float]:
    """Per group, the sum of its run of values (np.sum of each slice, as one group's array sums)."""
    ends = np.cumsum(lengths)
    return [float(values[e - n:e].sum()) for e, n in zip(ends.tolist(), lengths.tolist())]


def _cycles_laid_out(cost: CostModel, pol: Policy, P, trajs):
    """The cycles of trajs (one per sampled request) as flat arrays, row after row, with each
    cycle's KV (the row's prompt + 1 + the tokens it emitted before the cycle): what _set_batches
    reads for any batch size, cut to the rows it batches (a prefix)."""
    cycles = np.array([len(t.emitted) for t in trajs], dtype=np.int64)
    emitted = np.concatenate([t.emitted for t in trajs] + [np.zeros(0, dtype=np.int64)])
    row_emitted = np.array([t.emitted.sum() for t in trajs], dtype=np.int64)
    # tokens emitted before each cycle in its own row: before it over all rows, less the rows before
    before = np.cumsum(emitted) - emitted - np.repeat(np.cumsum(row_emitted) - row_emitted, cycles)
    missed = None
    if _charges_catch_up(cost, pol):
        missed = np.concatenate([missed_tokens(t.emitted, t.ran, int(p)) for t, p in zip(trajs, P)]
                                + [np.zeros((0, len(pol.methods)))])
    return SimpleNamespace(
        cycles=cycles, ends=np.cumsum(cycles), emitted=emitted, missed=missed,
        il=np.concatenate([t.input_len for t in trajs] + [np.zeros(0, dtype=np.int64)]),
        ran=np.concatenate([t.ran for t in trajs] + [np.zeros((0, len(pol.methods)), dtype=bool)]),
        win=np.concatenate([t.winner for t in trajs] + [np.zeros(0, dtype=np.int64)]),
        row_kv=np.repeat(P + 1, cycles) + before)


def _batch_steps(group, n_groups: int, length_per_row):
    """Each row's steps 0 .. length - 1 at its batch's steps (a batch as long as its longest row):
    (flat step index of every row step, step of it within the row, steps per batch)."""
    steps = np.zeros(n_groups, dtype=np.int64)
    np.maximum.at(steps, group, length_per_row)
    first = np.cumsum(steps) - steps
    within = positions_within(length_per_row)
    return np.repeat(first[group], length_per_row) + within, within, steps


# The baseline of a set of batches (its prefills, tokens and decode seconds per batch) is the same
# for every policy replayed over the same requests: kept for the policies after the first, keyed
# by the cost model's fields, the rows' prompt and generation lengths, and the batch size.
_BASELINES: dict = {}


def _baseline_batches(cost: CostModel, P, G, B: int):
    key = (repr(cost), P.tobytes(), G.tobytes(), B)
    if key in _BASELINES:
        return _BASELINES[key]
    n_rows = len(P)
    group = np.arange(n_rows) // B
    n_groups = int(group[-1]) + 1 if n_rows else 0
    pre = [cost.prefill(float(p)) + cost.overhead_per_step for p in np.bincount(group, weights=P, minlength=n_groups)]
    tok = [float(g) for g in np.bincount(group, weights=G, minlength=n_groups)]
    # step s decodes the rows with G - 1 > s, each at KV P + 1 + s
    at, s, steps = _batch_steps(group, n_groups, np.maximum(G - 1, 0))
    n = int(steps.sum())
    kv = np.bincount(at, weights=np.repeat(P + 1, np.maximum(G - 1, 0)) + s, minlength=n)
    active = np.bincount(at, minlength=n)
    base = _group_sums(cost.verify(kv, active) + cost.overhead_per_step, steps)
    if len(_BASELINES) >= 64:  # a long session over many files: keep the memory bounded
        _BASELINES.clear()
    _BASELINES[key] = group, n_groups, pre, tok, base
    return _BASELINES[key]


def _set_batches(cost: CostModel, pol: Policy, accounting: str, P, G, laid_out, rows: int, B: int):
    """Tokens and the baseline's and policy's seconds over batches of B consecutive rows of the
    first `rows` (the last batch may be short): in a step every active row's cycle is verified in
    one forward, which waits for the slowest row's drafting; rows leave when they finish. All
    batches at once: each row's cycles (laid_out: _cycles_laid_out) are laid out at (batch, step)
    and the forwards' tokens summed per step."""
    group, n_groups, pre, tok, base = _baseline_batches(cost, P[:rows], G[:rows], B)
    # speculative: cycle c of a row verifies il[c] tokens at KV P + 1 + the tokens emitted before it
    cut = int(laid_out.ends[rows - 1]) if rows else 0
    at, c, steps = _batch_steps(group, n_groups, laid_out.cycles[:rows])
    n = int(steps.sum())
    il, win, row_kv = laid_out.il[:cut], laid_out.win[:cut], laid_out.row_kv[:cut]
    verify = cost.verify(np.bincount(at, weights=row_kv, minlength=n), np.bincount(at, weights=il, minlength=n))
    draft = np.zeros(n)
    missed = None if laid_out.missed is None else laid_out.missed[:cut]
    np.maximum.at(draft, at, pol.draft_time(cost, accounting, laid_out.ran[:cut], verify[at],
                                             row_kv.astype(np.float64), il.astype(np.float64), missed))
    step = verify + draft + cost.overhead_per_step
    if pol.charges_switching(accounting):  # a step where any row's drafter changed from its last cycle
        switched = np.zeros(n, dtype=bool)
        changed = np.flatnonzero((c[1:] > 0) & (win[1:] != win[:-1])) + 1
        switched[at[changed]] = True
        step = step + switched * cost.switching_cost
    spec = _group_sums(step, steps)
    tok_sum = base_sum = spec_sum = 0.0
    for g in range(n_groups):  # summed batch by batch, in order
        tok_sum += tok[g]
        base_sum += pre[g] + base[g]
        spec_sum += pre[g] + spec[g]
    return tok_sum, base_sum, spec_sum


TUNE_SEED = 7  # the fixed split of --tune: which sampled requests fit parameters, which are scored


def tune_split(traces: list[Trace], methods, n_requests: int = 300, seed: int = TUNE_SEED):
    """The sampled requests (as every policy sees them) in two disjoint halves, fixed by seed:
    (first, second). --tune fits parameters on each and scores them on the other (_cross_fitted)."""
    reqs = sample_requests(traces, methods, n_requests)
    order = list(range(len(reqs)))
    random.Random(seed).shuffle(order)
    half = len(reqs) // 2
    return [reqs[i] for i in sorted(order[:half])], [reqs[i] for i in sorted(order[half:])]


def _simulator(batch_mode: str):
    def sim(traces, pol, cost, batch_sizes, accounting, n_requests, dataset):
        if batch_mode == "repeat":
            return simulate(traces, pol, cost, batch_sizes, accounting, n_requests, dataset)
        if not pol.replays_trace:
            raise ValueError(f"policy {pol.name} models the published repeat batches; use --batch-mode repeat")
        return simulate_set(traces, pol, cost, batch_sizes, accounting, n_requests)
    return sim


def lacking_signals(traces, pol: Policy) -> list[tuple[str, str]]:
    """What pol needs (draft_len, match_len, draft_prob of its methods) and no trace of its methods
    records, as (field, method) pairs: pol is n/a on these traces when it is not empty."""
    have = [t for t in traces if all(m in t.acc for m in pol.methods)]
    per = [set(pol.missing_signals(t)) for t in have]
    return sorted(set.intersection(*per)) if per else []


def _tuned(sim, fit, pol, cost, batch_sizes, accounting, dataset):
    """Per batch size, the candidate of pol.tune_grid() with the highest speedup on the fit half."""
    scores = [(c, sim(fit, c, cost, batch_sizes, accounting, len(fit), dataset)["speedup"]) for c in pol.tune_grid()]
    return [max(scores, key=lambda cs: cs[1][j])[0] for j in range(len(batch_sizes))]


def _warn_read_as_published(traces, dataset: str, warn) -> None:
    """Say how often a trace file needed the published traces' reading (tracefile's docstring)."""
    own = [t for t in traces if t.own_length]
    if own:
        methods = sorted({m for t in own for m in t.own_length})
        warn(f"{dataset}: {len(own)} of {len(traces)} traces record a method's own generation ({', '.join(methods)}: "
             "an acc_len of another length than generated_token_ids); a policy over several methods runs over the "
             "shortest, as the published simulator does")
    past_end = sum(t.past_end for t in traces)
    if past_end:
        warn(f"{dataset}: {past_end} acc_len values exceed the tokens left in their generation (in "
             f"{sum(t.past_end > 0 for t in traces)} traces): kept as recorded, as the published simulator reads "
             "them; a cycle there ends the request")


def run(trace_files, cost: CostModel, batch_sizes, accountings, policy_specs=None, n_requests: int = 300,
        batch_mode: str = "set", tune: bool = False, warn=None, lookups=(), jobs: int = 1, while_waiting=None):
    """Every policy x accounting x batch size for every trace file; returns a DataFrame.

    tune: parameters of the policies that have a tune_grid are fitted on one half of the sampled
    requests (tune_split) per batch size and accounting, and every policy is scored on the other
    half (column half = "score"; "all" without tune). A policy that needs what the traces lack
    (draft_len, match_len, draft_prob) is n/a there: skipped, and warn(message) says so.
    lookups: (method, knobs) pairs whose lookup is recomputed from the token ids where a trace
    records no match_len (tracefile.recompute_lookup); warn says how often it agrees with the
    trace's acc_len. jobs: trace files simulated in that many processes at once (each file is
    independent; the rows and messages come back in file order, the same as with one).
    while_waiting: the caller's own work (a callable), run once in this process as soon as a
    worker has nothing left to start, so that it overlaps the last files' simulation instead of
    following it (with one process: after the simulation)."""
    import pandas as pd

    args = (cost, batch_sizes, accountings, policy_specs, n_requests, batch_mode, tune, warn is not None, tuple(lookups))
    files = [str(f) for f in trace_files]
    if jobs > 1 and len(files) > 1:
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        workers = min(jobs, len(files))
        with ProcessPoolExecutor(max_workers=workers) as pool:
            # the largest files first, so that no worker is left with a large one at the end
            by_size = sorted(files, key=lambda f: -Path(f).stat().st_size)
            futures = {f: pool.submit(_file_rows, f, *args) for f in by_size}
            if while_waiting is not None:
                running = set(futures.values())
                while len(running) >= workers:  # every file started, and a worker idle: a CPU is free
                    _, running = wait(running, return_when=FIRST_COMPLETED)
                while_waiting()
            results = [futures[f].result() for f in files]
    else:
        results = [_file_rows(f, *args) for f in files]
        if while_waiting is not None:
            while_waiting()
    rows = []
    for file_rows, messages in results:
        for m in messages:
            warn(m)
        rows += file_rows
    if not rows:
        raise ValueError("no rows: every policy asked for is n/a on these traces (see above)")
    return add_gap_closed(pd.DataFrame(rows))


def _replay_lookups(traces, lookups, dataset: str, warn) -> None:
    """Each lookup of `lookups` (method, knobs with k) recomputed from the traces' token ids into
    their acceptance (recompute_lookup), and with warn, how well it agrees with the trace's own."""
    for method, knobs in lookups:
        knobs = dict(knobs)
        k = knobs.pop("k")
        if knobs.get("as_method"):  # a lookup of its own: declared here, in the process that replays it
            declare([f"{knobs['as_method']}=lookup"])
        got = recompute_lookup(traces, method, k, **knobs)
        if warn is not None:
            share = f"{got['agree'] / got['positions']:.2%}" if got["positions"] else "-"
            how = (f"match lengths {knobs['min_ngram']}-{knobs['max_ngram']}, "
                   f"{'latest' if knobs['prefer_recent'] else 'earliest'} occurrence, up to {k} tokens")
            when = ("prompt + generated[:i], the published traces' alignment" if got["context_offset"] == 0
                    else "prompt + generated[:i + 1], specsweep's alignment")
            what = (f"{knobs['as_method']}, a lookup of its own (acc_len, draft_len and match_len), replayed"
                    if knobs.get("as_method") else f"{method}'s lookup recomputed")
            agrees = (f"it agrees with {method}'s acc_len" if knobs.get("as_method")
                      else "its acc_len agrees with the trace's")
            warn(f"{dataset}: {what} from the token ids of {got['traces']} traces ({how}; position i drafted "
                 f"from {when}, the one that agrees more with {method}'s trace); {agrees} at {share} of "
                 f"{got['positions']} positions")


def _policies(traces, methods: list[str], policy_specs, batch_mode: str, dataset: str) -> list:
    """The policies to simulate: those asked for, else the defaults (the published ones, then the
    adaptive rules and the dp bound)."""
    pols = [Policy.parse(s) for s in policy_specs] if policy_specs else default_policies(methods)
    if not policy_specs and batch_mode == "repeat" and dataset in PUBLISHED_MATCH_PROB:
        pols += [RandMatch((m,), k) for m in methods if is_lookup(m) for k in (1, 3, 5)]
    if not policy_specs:  # the adaptive rules and the dp bound come after the published ones
        pols += adaptive_defaults(methods, conf_kmax=confidence_width(traces))
    return pols


def _file_rows(f: str, cost: CostModel, batch_sizes, accountings, policy_specs, n_requests: int, batch_mode: str,
               tune: bool, say_na: bool, lookups) -> tuple[list[dict], list[str]]:
    """run's rows for one trace file, and the messages for its warn (none unless say_na: then a
    policy n/a on the file is skipped and said, else it is an error)."""
    from ..costmodel import neural_charge

    messages = []
    warn = messages.append if say_na else None
    sim = _simulator(batch_mode)
    rows = []
    traces = load_traces(f)
    dataset = Path(f).stem.removeprefix("combined_")
    if warn is not None:
        _warn_read_as_published(traces, dataset, warn)
    _replay_lookups(traces, lookups, dataset, warn)
    methods = sorted({m for t in traces for m in t.acc}, key=lambda m: (not is_lookup(m), m))
    pols = _policies(traces, methods, policy_specs, batch_mode, dataset)
    for pol in pols:
        _check_methods(traces, pol)
        lacking = lacking_signals(traces, pol)
        if lacking:
            if policy_specs and warn is None:
                raise ValueError(f"policy {pol.name}: n/a on {f}: it needs the {pol.say_missing(lacking)}, which "
                                 "the traces do not record")
            if warn is not None:
                warn(f"policy {pol.name}: n/a on {dataset} (the traces record no {pol.say_missing(lacking)})")
            continue
        simulated = accountings if pol.accounting_matters(cost) else accountings[:1]  # the same in both
        for accounting in simulated:
            runs = (_cross_fitted(sim, traces, pol, cost, batch_sizes, accounting, n_requests, dataset) if tune else
                    [("all", pol.name, pol.k, sim(traces, pol, cost, batch_sizes, accounting, n_requests, dataset))])
            template = pol.name if tune and hasattr(pol, "tune_grid") else None
            for half, name, k, r in runs:
                tpf = r.get("tokens_per_forward_by_batch") or [r["tokens_per_forward"]] * len(r["batch_sizes"])
                for b, s, tp in zip(r["batch_sizes"], r["speedup"], tpf):
                    for a in (accountings if len(simulated) == 1 else [accounting]):
                        rows.append({"dataset": dataset, "policy": name, "kind": pol.kind,
                                     "methods": "+".join(pol.methods), "k": k or None, "batch_size": b,
                                     "accounting": a, "speedup": s, "tokens_per_forward": tp,
                                     "requests": r["requests"], "cost_model": cost.name, "batch_mode": batch_mode,
                                     "realizable": pol.realizable,
                                     "approximate": pol.kind == "dp" and b > 1,
                                     "neural_draft_charge": neural_charge(cost),
                                     "half": half, "tuned_from": template})
    return rows, messages


def _cross_fitted(sim, traces, pol, cost, batch_sizes, accounting, n_requests, dataset):
    """--tune's rows for one policy and accounting, per batch size: (half, policy name, k, result).

    The sampled requests are split in two halves (tune_split); a policy with a tune_grid is fitted
    on each half and scored on the other (cross-fitting), so that every request is scored by
    parameters fitted without it. half "first" is the first half scored (under the parameters
    fitted on the second), "second" the reverse, "both" every sampled request (the two together:
    sums of times, not a mean of speedups). A policy without parameters is simply scored on each
    half. name is the spec used, "A / B" where the two halves' fits differ (A scored the first)."""
    first, second = tune_split(traces, pol.methods, n_requests)
    fitted = [_tuned(sim, fit, pol, cost, batch_sizes, accounting, dataset) if hasattr(pol, "tune_grid")
              else [pol] * len(batch_sizes) for fit in (second, first)]  # the specs that score first, second
    out = []
    for b, pa, pb in zip(batch_sizes, *fitted):
        ra, rb = (sim(score, p, cost, [b], accounting, len(score), dataset) for score, p in ((first, pa), (second, pb)))
        out += [("first", pa.name, pa.k, ra), ("second", pb.name, pb.k, rb)]
        same = pa.name == pb.name
        out.append(("both", pa.name if same else f"{pa.name} / {pb.name}", pa.k if pa.k == pb.k else None,
                    combine([ra, rb])))
    return out


GAP_KEYS = ["dataset", "batch_size", "accounting", "neural_draft_charge", "half"]


def add_gap_closed(df):
    """gap_closed = (speedup - best fixed) / (dp - best fixed) per dataset, batch size, accounting
    (and draft charge, half): best fixed is the best fixed:M:K row of the group, dp its best dp row.
    NaN where the group has no fixed or no dp row, or dp does not beat the best fixed."""
    df = df.copy()
    keys = [df[k].fillna("") for k in GAP_KEYS]
    best_fixed = df.speedup.where(df.kind == "fixed").groupby(keys).transform("max")
    dp = df.speedup.where(df.kind == "dp").groupby(keys).transform("max")
    gap = dp - best_fixed
    df["gap_closed"] = ((df.speedup - best_fixed) / gap).where(gap > 1e-12)
    return df


CONF_THRESHOLD = 0.3  # the default conf policies' threshold (chosen before any measurement; --tune fits it)


def confidence_width(traces) -> int | None:
    """The most drafts per cycle whose probabilities a trace records (draft_prob), None if none does."""
    widths = [c.shape[1] for t in traces for c in (t.confidence or {}).values()]
    return max(widths) if widths else None


def adaptive_defaults(methods: list[str], kmax: int = 8, conf_kmax: int | None = None) -> list[Policy]:
    """The default adaptive rules and bound: ema (k0 3) per method, goodput and a ucb over all,
    match from the first lookup to the first model drafter, conf on the first model drafter alone
    and after the first lookup (KMAX = conf_kmax, the traces' draft_prob width, else kmax; n/a
    without draft_prob), dp over all."""
    cheap = [m for m in methods if is_lookup(m)]
    neural = [m for m in methods if not is_lookup(m)]
    ms = tuple(cheap + neural)
    pols = [Policy.parse(f"ema:{m}:3") for m in ms]
    pols += [Policy.parse(f"goodput:{'+'.join(ms)}:{kmax}"), Policy.parse(f"ucb:{'+'.join(ms)}:1,3,5")]
    if cheap and neural:
        pols.append(Policy.parse(f"match:{cheap[0]}+{neural[0]}:1:{kmax}:3"))
    if neural:
        kc = conf_kmax or kmax
        pols.append(Policy.parse(f"conf:{neural[0]}:{kc}:{CONF_THRESHOLD:g}"))
        if cheap:
            pols.append(Policy.parse(f"conf:{cheap[0]}+{neural[0]}:1:{kmax}:{kc}:{CONF_THRESHOLD:g}"))
    pols.append(Policy.parse(f"dp:{'+'.join(ms)}:{kmax}"))
    return pols
