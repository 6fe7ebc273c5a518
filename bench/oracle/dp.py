"""dp: the clairvoyant bound on per-cycle choices of method and k.

For one request, every cycle from generated position i picks (method w, drafts k), k = 0 a plain
decode step; it costs the verify of k + 1 tokens, w's draft time for k (none at k = 0), the step
overhead and, in the faithful accounting, the switching cost when w differs from the previous
cycle's; it emits min(acc_len_w[i], k + 1). Dynamic programming over positions (and the previous
method, which the switching cost needs) finds the sequence with the least total time, i.e. the
most throughput. Only the chosen drafter is charged (a clairvoyant decoder need not run the others),
in both accountings, which differ by the switching cost.

Exact at batch 1: the costs are the simulators' own. Above batch 1 each row is planned as if the
batch were B rows like it (verify of B x (k + 1) tokens at B x its KV), which is an approximation
(its rows carry approximate = True): the true set-batch optimum couples the rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .policies import Policy, PolicyError, _draft_length
from .tracefile import generated_len


def plan_costs(pol: Policy, t, ctx):
    """Per position, method and k in 0..KMAX: the cycle's seconds (inf where a lookup cannot propose
    k) and tokens emitted; arrays [G - 1, W, KMAX + 1] for positions 0..G - 2."""
    G = generated_len(t, pol.methods)
    B, cost = ctx.batch_size, ctx.cost
    pos = np.arange(G - 1, dtype=np.float64)[:, None, None]
    ks = np.arange(pol.k + 1)[None, None, :]
    il = (ks + 1).astype(np.float64)
    kv = B * (t.prompt_len + 1 + pos)
    verify = cost.verify(kv, B * il)
    sec = np.zeros((G - 1, len(pol.methods), pol.k + 1))
    emitted = np.zeros(sec.shape, dtype=np.int64)
    for w, m in enumerate(pol.methods):
        draft = cost.draft(m).time(verify, kv, il)[:, 0, :]
        sec[:, w, :] = verify[:, 0, :] + np.where(ks[0] > 0, draft, 0.0) + cost.overhead_per_step
        acc = np.asarray(t.acc[m][:G - 1])
        emitted[:, w, :] = np.minimum(acc[:, None], ks[0] + 1)
        d = (t.drafted or {}).get(m)
        if d is not None:  # a lookup proposes at most what it found
            sec[:, w, :] = np.where(ks[0][None, :] > np.asarray(d[:G - 1])[:, None], np.inf, sec[:, w, :])
    return sec, emitted


def solve(pol: Policy, t, ctx) -> tuple[list[tuple[int, int]], float]:
    """The least-time sequence of (method, k) from the first decode position, and its seconds
    (cycles only: prefill is the same for every plan)."""
    G = generated_len(t, pol.methods)
    if G <= 1:
        return [], 0.0
    sec, emitted = plan_costs(pol, t, ctx)
    W = len(pol.methods)
    sw = ctx.cost.switching_cost if pol.charges_switching(ctx.accounting) else 0.0
    # state: the previous cycle's method, W = none yet (the first cycle switches from nothing)
    switch = sw * (np.arange(W + 1)[:, None] != np.arange(W)[None, :])
    switch[W] = 0.0
    V = np.zeros((G + 2, W + 1))  # seconds left from position cur with that previous method
    best_w = np.zeros((G + 2, W + 1), dtype=np.int64)
    best_k = np.zeros((G + 2, W + 1), dtype=np.int64)
    rows = np.arange(W)[:, None]
    for cur in range(G - 1, 0, -1):
        pos = cur - 1
        nxt = np.minimum(cur + emitted[pos], G)
        cand = sec[pos] + V[nxt, rows]  # [W, K + 1]: this cycle, then the best from where it lands
        k = cand.argmin(1)
        tot = cand[np.arange(W), k][None, :] + switch  # [W + 1, W]
        w = tot.argmin(1)
        V[cur] = tot[np.arange(W + 1), w]
        best_w[cur], best_k[cur] = w, k[w]
    plan, cur, lw = [], 1, W
    while cur < G:
        w, k = int(best_w[cur, lw]), int(best_k[cur, lw])
        plan.append((w, k))
        cur += int(emitted[cur - 1, w, k])
        lw = w
    return plan, float(V[1, W])


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

    def proposer(self, t, ctx):
        if ctx is None:
            raise PolicyError(f"policy {self.name}: the bound needs a cost model and batch size (a Context)")
        plan = iter(solve(self, t, ctx)[0])

        def propose(pos, acc_lens, drafted, prev):
            w, k = next(plan)
            return w, k + 1, tuple(j == w and k > 0 for j in range(len(self.methods)))
        return propose
