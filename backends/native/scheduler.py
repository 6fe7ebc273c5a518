"""Continuous batching for the native engine: requests are submitted as a LoadPlan says (a closed
loop of N outstanding, or arrivals at set times), join free KV-cache slots at cycle boundaries,
and leave the moment they finish. Every cycle is engine.cycle over the rows in flight, the same
function a static batch runs through."""
from __future__ import annotations

import heapq
import time

import torch

from bench.backend import LoadPlan

from .drafters import Drafter, NoDrafter
from .engine import Row, RowOutput, Target, _clock, cycle, max_len_for, prefill, setup
from .sampling import SamplingParams


def check_plan(plan: LoadPlan, n: int) -> None:
    if plan.kind not in ("concurrency", "rate"):
        raise ValueError(f"load kind {plan.kind!r} is not served by the native engine; use concurrency or rate")
    if plan.max_rows < 1:
        raise ValueError(f"load max_rows={plan.max_rows} is not valid; use 1 or more")
    if plan.kind == "concurrency" and not (plan.concurrency or 0) >= 1:
        raise ValueError(f"load concurrency={plan.concurrency} is not valid; use 1 or more")
    if plan.kind == "rate" and (plan.arrivals_s is None or len(plan.arrivals_s) != n):
        raise ValueError(f"a rate plan needs one arrival time per request ({n}), got "
                         f"{None if plan.arrivals_s is None else len(plan.arrivals_s)}")


class _Slots:
    """A run's requests as the plan submits them, and the KV-cache slots they hold: when each is
    submitted since the run began (under a closed loop request N + j is submitted when the j-th
    request finishes, so its time is unknown, None, until then), the free slots (a heap: the
    lowest first), the next request to admit, and what admitting and finishing one does."""

    def __init__(self, plan: LoadPlan, n: int, drafter: Drafter):
        self.plan, self.n, self.drafter = plan, n, drafter
        self.closed = plan.kind == "concurrency"
        self.submit = ([0.0] * plan.concurrency + [None] * n)[:n] if self.closed else [float(t) for t in plan.arrivals_s]
        self.free = list(range(plan.max_rows))
        self.next = self.finished = 0

    def due(self, now: float) -> bool:
        """Whether the next request was submitted by `now` and a slot is free for it."""
        return bool(self.free) and self.next < self.n and self.submit[self.next] is not None and self.submit[self.next] <= now

    def take(self, rows: list[Row]) -> Row:
        r = rows[self.next]
        self.next += 1
        r.slot, r.out.submitted_s = heapq.heappop(self.free), self.submit[r.req]
        return r

    def wait_s(self, now: float) -> float:
        return max(0.0, self.submit[self.next] - now)

    def leave(self, r: Row) -> None:
        self.drafter.release(r.slot)  # engine.cycle released it already; a row done at prefill was not
        heapq.heappush(self.free, r.slot)
        if self.closed and self.plan.concurrency + self.finished < self.n:  # the closed loop submits the next request
            self.submit[self.plan.concurrency + self.finished] = r.out.submitted_s + r.out.emit_times[-1]
        self.finished += 1


@torch.inference_mode()
def serve(
    model: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    sp: SamplingParams,
    plan: LoadPlan,
    drafter: Drafter | None = None,
    eos_ids: tuple[int, ...] = (),
    gen: torch.Generator | None = None,
    trace: bool = True,
    sleep=time.sleep,
):
    """Serve the prompts under the plan in plan.max_rows KV-cache slots. Returns (rows, cycles,
    wall) as engine.generate does: one RowOutput per prompt in prompt order, its submitted_s the
    time since the run began at which it was submitted (its arrival; under concurrency the
    moment a predecessor finished, 0 for the first N) and its ttft_s and emit_times counted from
    then, so they include its wait for a slot; one trace record per (cycle, row) with `row` the
    request index, `slot` its KV slot, `t` the cycle's start since the run began and batch_rows
    the rows it verified; wall the seconds from the run's start to the last token."""
    drafter = NoDrafter() if drafter is None else drafter
    dev = model.device
    n = len(prompts)
    check_plan(plan, n)
    setup(model, drafter, plan.max_rows, max_len_for(prompts, max_new_tokens, drafter))
    rows = [Row(-1, i, list(p), RowOutput(list(p))) for i, p in enumerate(prompts)]
    slots = _Slots(plan, n, drafter)
    active: list[Row] = []
    cycles: list[dict] = []
    index = 0
    t_start = _clock(dev)
    while slots.next < n or active:
        # Admission, at a cycle boundary: submitted requests in order, while a slot is free.
        while slots.due(_clock(dev) - t_start):
            r = slots.take(rows)
            if prefill(model, drafter, r, sp, gen, max_new_tokens, eos_ids, t_start):
                active.append(r)
            else:
                slots.leave(r)
        if not active:
            if slots.next < n:  # idle until the next arrival (only a rate plan can leave the engine idle)
                sleep(slots.wait_s(_clock(dev) - t_start))
            continue
        active.sort(key=lambda r: r.slot)  # ascending slots: the cache reads them as one slice when contiguous
        t = _clock(dev) - t_start
        still, records = cycle(model, drafter, active, sp, gen, max_new_tokens, eos_ids, t_start, index)
        for r in active:
            if r not in still:
                slots.leave(r)
        if trace:
            for r, rec in zip(active, records):
                rec.update(slot=r.slot, t=t)
            cycles += records
        active, index = still, index + 1
    outs = [r.out for r in rows]
    return outs, cycles, max((o.submitted_s + o.emit_times[-1] for o in outs), default=0.0)
