"""Lanes: many replays of one policy stepped together, as numpy arrays.

A lane is one request replayed under one Context (batch size; the cost model and accounting are
the same for every lane of a replay). Policies decide for many lanes at once (Policy.decide), so
the simulators replay every request, and every batch size of a batch-aware policy, in one pass:
- a stateless policy (its choice at a position depends on nothing it has seen) decides every
  position of every lane in one call, and each lane's cycles are then read off by walking its
  positions (walk_stateless);
- a policy with state steps all lanes in lockstep, one cycle per step, each lane at its own
  position, until every lane has finished (walk_lockstep).
The per-lane arrays of a request (acc_len, draft_len per method) are stored once, flat, and a lane
reads them at offset[lane] + pos.
"""
from __future__ import annotations

import numpy as np

from .tracefile import generated_len


class Lanes:
    """traces x ctxs as lanes, context-major: lane c * len(traces) + r is request r under ctxs[c].
    Traces without acc_len (an engine's row: id, prompt_len, drafted) give lanes of no positions,
    for the policies that decide from the past only."""

    def __init__(self, traces, ctxs, methods):
        self.traces, self.ctxs, self.methods = list(traces), list(ctxs), tuple(methods)
        R, C, W = len(self.traces), len(self.ctxs), len(self.methods)
        given = [c for c in self.ctxs if c is not None]
        if any(c.cost is not given[0].cost or c.accounting != given[0].accounting for c in given):
            raise ValueError("lanes of one replay share a cost model and an accounting")
        self.cost = given[0].cost if given else None
        self.accounting = given[0].accounting if given else None
        self.req = np.tile(np.arange(R), C)
        self.batch = np.repeat(np.array([1 if c is None else c.batch_size for c in self.ctxs], dtype=np.int64), R)
        self.prompt_len = np.array([t.prompt_len for t in self.traces], dtype=np.int64)[self.req]
        with_acc = [getattr(t, "acc", None) is not None for t in self.traces]
        G = np.array([generated_len(t, self.methods) if a else 0 for t, a in zip(self.traces, with_acc)], dtype=np.int64)
        self.G = G[self.req]
        n = np.maximum(G - 1, 0)  # positions a cycle can start at: 0 .. G - 2
        self.positions = n  # per request
        starts = np.concatenate(([0], np.cumsum(n)[:-1])) if R else np.zeros(0, dtype=np.int64)
        self.offset = starts[self.req]
        self.acc = np.ones((W, int(n.sum())), dtype=np.int64)
        self.drafted = np.zeros((W, int(n.sum())), dtype=np.int64)
        has = np.zeros((R, W), dtype=bool)
        for r, t in enumerate(self.traces):
            for j, m in enumerate(self.methods):
                if with_acc[r]:
                    self.acc[j, starts[r]:starts[r] + n[r]] = np.asarray(t.acc[m])[:n[r]]
                d = (getattr(t, "drafted", None) or {}).get(m)
                if d is not None:
                    has[r, j] = True
                    self.drafted[j, starts[r]:starts[r] + n[r]] = np.asarray(d)[:n[r]]
        self.has = has[self.req]  # [lanes, methods]: the trace records method j's draft lengths

    def __len__(self):
        return len(self.req)

    def by_request(self, per_request, fill=0) -> np.ndarray:
        """Per-request arrays, one row per position (1-D, or 2-D with rows of any width), laid out
        flat as acc and drafted are (read at offset[lane] + pos): each cut or padded with fill to its
        request's G - 1 positions, and 2-D rows padded with fill to the widest."""
        arrays = [np.asarray(a) for a in per_request]
        width = max((a.shape[1] for a in arrays if a.ndim == 2), default=None)
        out = []
        for a, n in zip(arrays, self.positions.tolist()):
            shape = (n,) if width is None else (n, width)
            row = np.full(shape, fill, dtype=np.float64 if isinstance(fill, float) else a.dtype)
            cut = a[:n] if width is None else a[:n, :width]
            row[:len(cut)] = cut if width is None else np.pad(cut, ((0, 0), (0, width - cut.shape[1])),
                                                               constant_values=fill)
            out.append(row)
        return np.concatenate(out) if out else np.full((0,) if width is None else (0, width), fill)

    def step_times(self, idx, pos, ks: np.ndarray):
        """For lanes idx at positions pos and draft counts ks: the target forward of a row in a batch
        of B rows like it (verify, [n, len(ks)]: KV of B x (prompt + 1 + pos), B x (k + 1) tokens)
        and each method's drafting for it ([W, n, len(ks)]): what a batch-aware policy (goodput, ucb)
        prices its choices by (exact at B = 1, where these are the simulators' own times)."""
        B = self.batch[idx][:, None]
        kv = B * (self.prompt_len[idx][:, None] + 1 + pos[:, None])
        il = ks[None, :] + 1
        verify = self.cost.verify(kv, B * il)
        drafts = np.empty((len(self.methods),) + verify.shape)
        for j, m in enumerate(self.methods):
            drafts[j] = self.cost.draft(m).time(verify, kv, il)
        return verify, drafts


def positions_within(lengths: np.ndarray) -> np.ndarray:
    """For runs of the given lengths laid end to end, each element's index within its run:
    [2, 3] -> [0, 1, 0, 1, 2]."""
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def _check_emits(emitted, lanes: Lanes, idx, pos, pol) -> None:
    bad = np.flatnonzero(emitted < 1)
    if len(bad):  # a trace or policy built around load_traces / Policy.parse: refuse rather than loop
        i = bad[0]
        t = lanes.traces[lanes.req[idx[i]]]
        raise ValueError(f"request {t.id}, policy {pol.name}: a cycle at position {int(pos[i])} would emit "
                         f"{int(emitted[i])} tokens")


def outcome(lanes: Lanes, fi, w, drafts):
    """What the cycles decide chose verify and emit: (tokens verified, tokens emitted, the method
    whose draft was kept). drafts is a draft count per cycle (method w's draft alone), or a row of
    counts per method (a tree: every method's draft a branch of one verify, one forward over all of
    them; the longest accepted branch is kept, w's on a tie, else the first method's)."""
    if drafts.ndim == 1:
        il = drafts + 1
        return il, np.minimum(lanes.acc[w, fi], il), w
    branch = np.where(drafts > 0, np.minimum(lanes.acc[:, fi].T, drafts + 1), 1)  # [n, W]
    emitted = branch.max(1)
    return drafts.sum(1) + 1, emitted, np.where(branch[np.arange(len(w)), w] == emitted, w, branch.argmax(1))


def _no_cycles(W: int):
    return (np.zeros(0, dtype=np.int64),) * 3 + (np.zeros((0, W), dtype=bool), np.zeros(0, dtype=np.int64))


def walk_stateless(pol, st, lanes: Lanes):
    """Every position of every lane decided at once, then each lane's cycles read off from position
    0: a cycle at pos emits e tokens and the next starts at pos + e. Returns the cycles as flat
    arrays (lane, input_len, emitted, ran, winner), grouped by lane in cycle order."""
    n = np.maximum(lanes.G - 1, 0)
    if not n.any():  # nothing to decide (every generation a single token)
        return _no_cycles(len(lanes.methods))
    idx = np.repeat(np.arange(len(lanes)), n)
    pos = positions_within(n)
    fi = lanes.offset[idx] + pos
    w, drafts, ran = pol.decide(st, idx, pos, lanes.drafted[:, fi].T, lanes.has[idx])
    il, emitted, w = outcome(lanes, fi, w, drafts)
    v = visited_positions(emitted, pos, n[idx], np.cumsum(n)[n > 0] - n[n > 0])
    bad = v[emitted[v] < 1]
    if len(bad):  # a trace or policy built around load_traces / Policy.parse: refuse rather than loop
        _check_emits(emitted[bad[:1]], lanes, idx[bad[:1]], pos[bad[:1]], pol)
    return idx[v], il[v], emitted[v], ran[v], w[v]


def visited_positions(step, pos, length, starts) -> np.ndarray:
    """The flat positions a walk visits: runs of positions laid end to end (pos, each one's index
    within its run; length, its run's length), each walked from its start (starts: flat indices)
    by jumps of step[i] (at least 1; a smaller one ends the run's walk there) until it leaves the
    run. Returned ascending, which is run by run, each in walk order.

    Pointer doubling rather than a Python step per cycle: with F = the jump applied 2^j times and
    S every run's first 2^j visits, F[S] are the next 2^j; both double each round, so a walk of c
    visits takes log2(c) rounds of array operations, and runs whose walk has ended drop out."""
    end = len(step)  # the sentinel: past the run (and it stays there)
    nxt = np.where((step >= 1) & (pos + step < length), np.arange(end) + step, end)
    jump = np.append(nxt, end)
    seen = [np.asarray(starts, dtype=np.int64)]
    alive = seen[0][:, None]
    while len(alive):
        ahead = jump[alive]
        done = ahead[:, -1] == end  # a walk ends at the sentinel, so the last of its visits tells
        seen.append(ahead[ahead != end])
        alive = np.concatenate([alive[~done], ahead[~done]], axis=1)
        if len(alive):
            jump = jump[jump]
    v = np.concatenate(seen)
    v.sort()
    return v


def walk_lockstep(pol, st, lanes: Lanes):
    """All lanes one cycle at a time, each at its own position, the policy deciding for the lanes
    still running and learning their outcomes; as walk_stateless returns. What the running lanes
    need each cycle (position, offset, length, has) is kept as arrays of its own and cut only when
    a lane finishes: a long request is thousands of cycles for a few lanes."""
    active = np.flatnonzero(lanes.G > 1)
    pos = np.zeros(len(active), dtype=np.int64)  # the first token comes from prefill: cycles start at 0
    offset, last, has = lanes.offset[active], lanes.G[active] - 1, lanes.has[active]
    out = []
    while len(active):
        fi = offset + pos
        w, drafts, ran = pol.decide(st, active, pos, lanes.drafted[:, fi].T, has)
        il, emitted, w = outcome(lanes, fi, w, drafts)
        if emitted.min() < 1:
            _check_emits(emitted, lanes, active, pos, pol)
        pol.learn(st, active, w, drafts, emitted)
        out.append((active, il, emitted, ran, w))
        pos = pos + emitted
        going = pos < last
        if not going.all():
            active, pos, offset, last, has = active[going], pos[going], offset[going], last[going], has[going]
    if not out:
        return _no_cycles(len(lanes.methods))
    lane, il, emitted, ran, w = (np.concatenate(x) for x in zip(*out))
    order = np.argsort(lane, kind="stable")  # by lane, each lane's cycles in order
    return lane[order], il[order], emitted[order], ran[order], w[order]
