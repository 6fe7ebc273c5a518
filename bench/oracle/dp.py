"""dp: the clairvoyant bound on per-cycle choices of method and k.

For one request, every cycle from generated position i picks (method w, drafts k), k = 0 a plain
decode step; it costs the verify of k + 1 tokens, w's draft time for k (none at k = 0), the step
overhead and, in the faithful accounting, the switching cost when w differs from the previous
cycle's; it emits min(acc_len_w[i], k + 1). Dynamic programming over positions (and the previous
method, which the switching cost needs) finds the sequence with the least total time, i.e. the
most throughput. Only the chosen drafter is charged (a clairvoyant decoder need not run the others),
in both accountings, which differ by the switching cost.

Exact at batch 1: the costs are the simulators' own, except a drafter's catch-up (DraftCost's
c_missed, 0 in the published constants), which depends on how long it sat out and which dp does
not charge: with it dp stays a bound (every path costs it no less) but is no longer exact. Above batch 1 each row is planned as if the
batch were B rows like it (verify of B x (k + 1) tokens at B x its KV), which is an approximation
(its rows carry approximate = True): the true set-batch optimum couples the rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from .policies import Policy, PolicyError, _draft_length


# Lane-positions whose cycle costs are computed together: the backward pass lays out the seconds
# of every (k, method) choice for a block of positions at once, so that each position's own step
# is a few array operations (a request of thousands of tokens is thousands of steps).
BLOCK_CELLS = 1 << 14


def _plan_layout(G: np.ndarray):
    """Where each lane's choices go: lanes ranked longest first (order, and each lane's rank), the
    last position any plans (top), per position the lanes still planning there (a prefix of the
    ranking) and where that position's rows start."""
    order = np.argsort(-G, kind="stable")  # longest first
    rank = np.empty(len(G), dtype=np.int64)
    rank[order] = np.arange(len(G))
    top = int(G.max(initial=0))
    planning = np.searchsorted(-G[order], -np.arange(top + 1), side="left")  # lanes with G - 1 >= cur
    planning[0] = 0  # position 0 is prefill's
    pos_start = np.concatenate(([0], np.cumsum(planning)[:-1])).astype(np.int64)
    return order, rank, top, planning, pos_start


def _cycle_seconds(lanes, drafters, A, pos, fi, K: int) -> np.ndarray:
    """The seconds of a cycle from each of a block's positions (pos, their flat trace index fi),
    per draft length k = 0..K, method and lane A: the verify of k + 1 tokens at the lane's batch and
    KV length, the method's drafting, the per-step overhead; inf where a lookup found fewer than k."""
    cost, ks = lanes.cost, np.arange(K + 1)
    il = ks + 1
    B = lanes.batch[A][None, None, :]
    kv = B * (pos[:, None, None] + lanes.prompt_len[A][None, None, :] + 1)  # [positions, 1, A]
    verify = cost.verify(kv, B * il[None, :, None])  # [positions, K + 1, A]
    sec = np.empty((len(pos), K + 1, len(drafters), len(A)))
    for w, dc in enumerate(drafters):
        s = verify + np.where(ks[:, None] > 0, dc.time(verify, kv, il[None, :, None]), 0.0) + cost.overhead_per_step
        # a lookup proposes at most what it found
        sec[:, :, w] = np.where(lanes.has[A, w][None, None, :] & (ks[None, :, None] > lanes.drafted[w, fi][:, None, :]),
                                np.inf, s)
    return sec


def _keep_choice(cand: np.ndarray, switch: np.ndarray | None, best_w, best_k, rows: slice) -> np.ndarray:
    """One position's choice from its candidates cand [K + 1, W, n] (seconds to the end of each
    (k, method) for n lanes): per previous method (with a switching cost, switch [W + 1, W]; else
    one for all) the least-time method and its first least k, written into the plan's rows, and
    the value of that choice returned ([W, n], or [n] without switching)."""
    n = cand.shape[-1]
    k = cand.argmin(0)  # [W, n]: the first k of the least time
    least = cand.min(0)
    if switch is not None:
        tot = least[None] + switch[:, :, None]  # [W + 1, W, n]
        w = tot.argmin(1)  # [W + 1, n]
        best_w[rows] = w.T
        best_k[rows] = k.reshape(-1)[w * n + np.arange(n)].T  # k of the method chosen, per previous
        return tot.min(1)[:cand.shape[1]]
    w = least.argmin(0)  # every previous method alike
    best_w[rows] = w[:, None]
    best_k[rows] = k[w, np.arange(n)][:, None]
    return least.min(0)


def solve(pol: Policy, lanes) -> SimpleNamespace:
    """The least-time plans of every lane (lanes.Lanes: requests x contexts) at once: per lane
    and position cur (1 .. G - 1) and previous method (W: none yet), the best (method, k) of the
    cycle starting there (rows pos_start[cur] + rank[lane] of w and k; only the choices are
    returned). Backwards over positions, every lane whose generation reaches cur in one step of
    arrays, lanes ranked longest first so that those still planning are a prefix.

    V(cur, prev) = the seconds from position cur to the end (0 at and past G: prefill is the same
    for every plan). A cycle from cur that emits e lands at cur + e, and e = min(acc_len, k + 1):
    for k + 1 <= acc_len at cur + k + 1, else at cur + acc_len. The values of the next K + 1
    positions are kept in a ring of slots (each lane's values 0 past its end), so no landing is
    looked up anywhere else."""
    W, K, cost, L = len(pol.methods), pol.k, lanes.cost, len(lanes.G)
    order, rank, top, planning, pos_start = _plan_layout(lanes.G)
    best_w = np.zeros((int(planning.sum()), W + 1), dtype=np.int8)
    best_k = np.zeros((int(planning.sum()), W + 1), dtype=np.int16)
    sw = cost.switching_cost if pol.charges_switching(lanes.accounting) else 0.0
    switch = sw * (np.arange(W + 1)[:, None] != np.arange(W)[None, :])  # [previous, method]
    switch[W] = 0.0  # the first cycle switches from nothing
    il = np.arange(K + 1) + 1
    drafters = [cost.draft(m) for m in pol.methods]
    # V(cur, previous method): without a switching cost the previous method changes nothing, so one
    # value per position (Pv = 1) stands for all of them and each position's choice is one argmin.
    Pv = W if sw else 1
    # The values of the next K + 1 positions, a ring of slots written twice (slot p % (K + 1) and
    # that + K + 1), so that those of cur + 1 .. cur + K + 1 are one view starting at
    # (cur + 1) % (K + 1): no position's values are moved once written. 0 past a lane's end.
    ring = np.zeros((2 * (K + 1), Pv, L))
    flat = ring.reshape(-1)
    plane = Pv * L  # one slot's values
    lane_of = np.arange(L)[None, :] + (np.arange(W)[:, None] * L if sw else 0)  # [W, L]: ring[0, prev = w, r]
    last_flat = max(lanes.acc.shape[1] - 1, 0)
    hi = top - 1
    while hi >= 1:
        n_top = int(planning[hi])
        lo = max(1, hi - max(1, BLOCK_CELLS // max(n_top, 1)) + 1)
        curs = np.arange(hi, lo - 1, -1)  # this block's positions, in the pass's order
        A = order[:int(planning[lo])]
        pos = curs - 1
        # a lane shorter than the block reads past its own positions: clipped, and never used
        fi = np.minimum(pos[:, None] + lanes.offset[A][None, :], last_flat)  # [positions, A]
        sec = _cycle_seconds(lanes, drafters, A, pos, fi, K)  # [positions, K + 1, W, A]
        acc = np.moveaxis(lanes.acc[:, fi], 0, 1)  # [positions, W, A]
        # where each choice lands: k + 1 <= acc_len at cur + k + 1 (ahead[k]), else at cur + acc_len
        # (ahead[acc_len - 1], read by its flat index in the ring less the slot's)
        beyond = il[None, :, None, None] > acc[:, None]  # [positions, K + 1, W, A]
        at_acc_index = (np.minimum(acc, K + 1) - 1) * plane + lane_of[:, :len(A)]  # [positions, W, A]
        for i, cur in enumerate(curs.tolist()):
            n = int(planning[cur])
            first = (cur + 1) % (K + 1)  # the slot of V(cur + 1)
            ahead = ring[first:first + K + 1, :, :n]  # [K + 1, Pv, n]: V(cur + 1 .. cur + K + 1)
            at_acc = flat[at_acc_index[i, :, :n] + first * plane]  # [W, n]
            cand = sec[i, :, :, :n] + np.where(beyond[i, :, :, :n], at_acc, ahead)  # [K + 1, W, n]
            rows = slice(pos_start[cur], pos_start[cur] + n)
            value = _keep_choice(cand, switch if sw else None, best_w, best_k, rows)
            slot = cur % (K + 1)
            ring[slot, :, :n] = value
            ring[slot + K + 1, :, :n] = value
        hi = lo - 1
    return SimpleNamespace(w=best_w, k=best_k, pos_start=pos_start, rank=rank)


@dataclass(frozen=True)
class Dp(Policy):
    """dp:M1[+M2...]:KMAX, the clairvoyant bound (module docstring). Not realizable."""
    kind, syntax = "dp", "dp:M1[+M2...]:KMAX"
    drafts_k = switches = batch_aware = True
    realizable = False

    @classmethod
    def from_args(cls, spec, args):
        if len(args) != 2 or not all(args[0].split("+")):
            return None
        return cls(tuple(args[0].split("+")), _draft_length(spec, args[1]))

    def exact(self, batch_size: int) -> bool:
        return batch_size == 1

    stateless = False  # each lane follows its plan from the previous cycle's method

    def start(self, lanes):
        if lanes.cost is None or any(c is None for c in lanes.ctxs):
            raise PolicyError(f"policy {self.name}: the bound needs a cost model and batch size (a Context)")
        st = solve(self, lanes)
        st.prev = np.full(len(lanes), len(self.methods))  # none yet
        return st

    def decide(self, st, idx, pos, avail, has):
        row = st.pos_start[pos + 1] + st.rank[idx]
        w, k = st.w[row, st.prev[idx]].astype(np.int64), st.k[row, st.prev[idx]].astype(np.int64)
        return w, k, (np.arange(len(self.methods))[None, :] == w[:, None]) & (k > 0)[:, None]

    def learn(self, st, idx, w, drafts, emitted):
        st.prev[idx] = w
