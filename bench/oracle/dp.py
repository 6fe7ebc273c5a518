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


def solve(pol: Policy, lanes) -> SimpleNamespace:
    """The least-time plans of every lane (lanes.Lanes: requests x contexts) at once: per lane,
    position cur (1 .. G - 1; row offset[lane] + cur of the tables) and previous method (W: none
    yet), the best (method, k) of the cycle starting there and the seconds from there to the end
    (cycles only: prefill is the same for every plan; only the choices are returned). Backwards
    over positions, every lane whose generation reaches cur in one step of arrays."""
    W, K, cost = len(pol.methods), pol.k, lanes.cost
    G = lanes.G
    offset = np.concatenate(([0], np.cumsum(G + 1)[:-1])).astype(np.int64)
    V = np.zeros((int((G + 1).sum()), W + 1))  # seconds left; row G of a lane (the end) stays 0
    best_w = np.zeros(V.shape, dtype=np.int8)
    best_k = np.zeros(V.shape, dtype=np.int16)
    sw = cost.switching_cost if pol.charges_switching(lanes.accounting) else 0.0
    switch = sw * (np.arange(W + 1)[:, None] != np.arange(W)[None, :])  # [previous, method]
    switch[W] = 0.0  # the first cycle switches from nothing
    order = np.argsort(-G, kind="stable")  # longest first: the lanes still planning at cur are a prefix
    longest_first = -G[order]
    ks = np.arange(K + 1)
    il = ks + 1
    drafters = [cost.draft(m) for m in pol.methods]
    methods = np.arange(W)[None, :, None]
    for cur in range(int(G.max(initial=0)) - 1, 0, -1):
        A = order[: np.searchsorted(longest_first, -(cur + 1), side="right")]  # lanes with G - 1 >= cur
        pos = cur - 1
        fi = lanes.offset[A] + pos
        B = lanes.batch[A][:, None]
        kv = B * (lanes.prompt_len[A][:, None] + 1 + pos)
        verify = cost.verify(kv, B * il[None, :])  # [A, K + 1]
        sec = np.empty((len(A), W, K + 1))
        for w, dc in enumerate(drafters):
            sec[:, w] = verify + np.where(ks > 0, dc.time(verify, kv, il[None, :]), 0.0) + cost.overhead_per_step
            # a lookup proposes at most what it found
            sec[:, w] = np.where(lanes.has[A, w][:, None] & (ks[None, :] > lanes.drafted[w, fi][:, None]), np.inf,
                                 sec[:, w])
        emitted = np.minimum(lanes.acc[:, fi].T[:, :, None], il[None, None, :])  # [A, W, K + 1]
        landing = np.minimum(cur + emitted, G[A][:, None, None])
        cand = sec + V[offset[A][:, None, None] + landing, methods]  # this cycle, then the best from where it lands
        k = cand.argmin(2)  # [A, W]
        tot = np.take_along_axis(cand, k[:, :, None], 2)[:, None, :, 0] + switch[None]  # [A, W + 1, W]
        w = tot.argmin(2)  # [A, W + 1]
        row = offset[A] + cur
        V[row] = np.take_along_axis(tot, w[:, :, None], 2)[:, :, 0]
        best_w[row], best_k[row] = w, np.take_along_axis(k, w, 1)
    return SimpleNamespace(w=best_w, k=best_k, offset=offset)


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
        row = st.offset[idx] + pos + 1
        w, k = st.w[row, st.prev[idx]].astype(np.int64), st.k[row, st.prev[idx]].astype(np.int64)
        return w, k, (np.arange(len(self.methods))[None, :] == w[:, None]) & (k > 0)[:, None]

    def learn(self, st, idx, w, drafts, emitted):
        st.prev[idx] = w
