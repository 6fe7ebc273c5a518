"""The draft/verify loop. `cycle` is one draft/verify step over the rows in flight; `generate`
runs a static ragged batch through it, and the continuous-batching scheduler (scheduler.serve)
runs a stream of requests through the same function. With no drafter every cycle is a plain
decode step, through the same code: the baseline."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from .drafters import Drafter, NoDrafter
from .model import prefill_pieces, write_kv
from .sampling import SamplingParams, accepted_prefix, select, verify


class Target(Protocol):
    """What the loop asks of the target model (model.Transformer; the llama.cpp worker's
    LlamaCppTarget): a KV cache of max_batch slots by max_len positions, a forward over some slots
    of it (rows) that writes every token's KV and gives logits where logits_for is True (flat, in
    row order), plus the captured hidden states when capture is given, and a rollback that keeps
    a slot's first positions (the KV of rejected drafts dropped, where the cache needs it)."""

    max_batch: int
    max_len: int
    device: torch.device  # where the loop's tensors live

    def setup_cache(self, max_batch: int, max_len: int) -> None: ...

    def __call__(self, tokens: Tensor, pos: Tensor, rows: Tensor | None = None, logits_for: Tensor | None = None,
                 capture: tuple | None = None): ...

    def rollback(self, slot: int, length: int) -> None: ...


@dataclass
class RowOutput:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    emit_times: list[float] = field(default_factory=list)  # seconds since submission, per cycle that emitted
    finished_by: str = "length"
    submitted_s: float = 0.0  # since the run began: 0 in a static batch, the request's submission under load


@dataclass(eq=False)  # rows compare by identity
class Row:
    """A request in flight: its KV-cache slot, its index among the run's requests, its tokens so
    far (prompt + output; the last one is not yet in the cache) and its output record."""
    slot: int
    req: int
    seq: list[int]
    out: RowOutput


def _clock(device) -> float:
    # Timing boundaries synchronize on accelerators, as Spec-Bench does.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def max_len_for(prompts: list[list[int]], max_new_tokens: int, drafter: Drafter) -> int:
    """KV-cache positions a row needs: its prompt, its output, and one padded draft past it."""
    return max(len(p) for p in prompts) + max_new_tokens + drafter.k + 2


def setup(model: Target, drafter: Drafter, max_batch: int, max_len: int) -> None:
    if model.max_batch < max_batch or model.max_len < max_len:
        model.setup_cache(max(max_batch, model.max_batch), max(max_len, model.max_len))
    drafter.setup(max_batch, max_len)


def prefill(model: Target, drafter: Drafter, row: Row, sp: SamplingParams, gen, max_new_tokens: int,
            eos_ids=(), t_start: float = 0.0) -> bool:
    """Fill the row's slot with its prompt (one row, no padding), pick its first token and hand
    the drafter the prompt, which resets whatever the slot's previous occupant left there. The
    target's rollback to 0 drops the previous occupant's KV where the cache needs that (llama.cpp);
    the native static cache does not: a query at position p attends to slots 0..p only
    (model.causal_mask), all written by this row before it reads them. Returns whether the row
    goes on."""
    dev = model.device
    p = row.seq
    model.rollback(row.slot, 0)  # a slot reused under load: its previous occupant's KV goes
    # A target that says so (prefill_chunk_tokens) takes a long prompt in pieces, each attending
    # to the cache the ones before it wrote: its attention then holds chunk x prompt scores at
    # most, not prompt x prompt (at 32k tokens, gigabytes a head). Only the last piece's last
    # position needs logits.
    slot, parts = torch.tensor([row.slot], device=dev), []
    for a, b in prefill_pieces(len(p), getattr(model, "prefill_chunk_tokens", None)):
        toks = torch.tensor([p[a:b]], device=dev)
        last = torch.zeros_like(toks, dtype=torch.bool)
        last[0, -1] = b == len(p)
        out = model(toks, torch.arange(a, b, device=dev)[None], rows=slot, logits_for=last, capture=drafter.capture)
        logits, f = out if drafter.capture else (out, None)
        parts.append(f)
    feats = torch.cat(parts, dim=1) if drafter.capture else None
    tok, _ = select(logits, sp, gen)
    drafter.prefill(row.slot, list(p), None if feats is None else feats[0])
    row.seq.append(int(tok))
    out = row.out
    out.tokens.append(int(tok))
    out.ttft_s = _clock(dev) - t_start - out.submitted_s
    out.emit_times.append(out.ttft_s)
    if int(tok) in eos_ids:
        out.finished_by = "eos"
    return out.finished_by != "eos" and len(out.tokens) < max_new_tokens


def _verify(logits, toks, need, drafts, qs, sp, gen, forced=None) -> list[tuple[int, list[int]]]:
    """Per row: (draft tokens accepted, tokens emitted = the accepted draft + the target's next).
    Greedy stays on the device but for K + 2 integers a row; sampling draws on the host, from
    the CPU generator the run is seeded with. forced (a synthetic drafter's): per row the count
    to accept whatever the tokens; the target chooses the token after them."""
    if forced is not None:
        widths = torch.tensor([len(d) + 1 for d in drafts])  # each row's verified positions, flat in row order
        at = (widths.cumsum(0) - widths + torch.tensor(forced)).to(logits.device)
        logits = logits[at]
        nxt, _ = select(logits.float().cpu() if not sp.greedy else logits, sp, gen)
        return [(a, d[:a] + [int(t)]) for d, a, t in zip(drafts, forced, nxt.tolist())]
    if sp.greedy:
        target = torch.full_like(toks, -1)
        target[need] = logits.argmax(-1)  # [B, K + 1]: the target's token after each draft prefix
        a = accepted_prefix(toks[:, 1:], target, need[:, 1:])
        # the accepted draft tokens equal the target's, so a row emits target[:a + 1]
        return [(h[0], h[1 : h[0] + 2]) for h in torch.cat((a[:, None], target), 1).tolist()]
    logits = logits.float().cpu() if logits.device.type != "cpu" else logits
    res = []
    for d, q, lg in zip(drafts, qs, torch.split(logits, [len(d) + 1 for d in drafts])):
        a, nxt = verify(d, q, lg, sp, gen)
        res.append((a, d[:a] + [nxt]))
    return res


def cycle(model: Target, drafter: Drafter, rows: list[Row], sp: SamplingParams, gen, max_new_tokens: int,
          eos_ids=(), t_start: float = 0.0, index: int = 0):
    """One draft/verify cycle over the rows in flight: the drafter proposes, one target forward
    verifies every row (its last token + its draft, right-padded to the longest), each row keeps
    its accepted prefix and the target's next token, cut at EOS and at max_new_tokens. Appends to
    each row and stamps its emit time; finished rows release their drafter state. Returns (the
    rows still going, one trace record per row)."""
    dev = model.device
    t0 = _clock(dev)
    prop = drafter.propose([r.slot for r in rows], [r.seq for r in rows], sp, gen)
    drafts = prop.tokens
    t1 = _clock(dev)
    K = max(len(d) for d in drafts)
    toks, pos, need = [], [], []
    for r, d in zip(rows, drafts):
        n = len(r.seq)
        x = [r.seq[-1]] + d
        need.append([True] * len(x) + [False] * (K + 1 - len(x)))
        toks.append(x + [x[-1]] * (K + 1 - len(x)))  # padding: its slots lie beyond the row
        pos.append(list(range(n - 1, n + K)))
    need_t, toks_t = torch.tensor(need, device=dev), torch.tensor(toks, device=dev)
    logits = model(toks_t, torch.tensor(pos, device=dev), rows=torch.tensor([r.slot for r in rows], device=dev),
                   logits_for=need_t, capture=drafter.capture)
    logits, feats = logits if drafter.capture else (logits, None)
    t2 = _clock(dev)
    verdicts = _verify(logits, toks_t, need_t, drafts, prop.probs, sp, gen, prop.forced)
    old_lens, still = [len(r.seq) for r in rows], []
    for r, (a, new) in zip(rows, verdicts):
        model.rollback(r.slot, len(r.seq) + a)  # its last token and the accepted drafts stay cached
        new = new[: max_new_tokens - len(r.out.tokens)]
        eos = next((j for j, t in enumerate(new) if t in eos_ids), None)
        if eos is not None:
            new, r.out.finished_by = new[: eos + 1], "eos"
        r.seq += new
        r.out.tokens += new
        if r.out.finished_by != "eos" and len(r.out.tokens) < max_new_tokens:
            still.append(r)
    drafter.accepted([r.slot for r in rows], old_lens, [a for a, _ in verdicts], feats)
    t3 = _clock(dev)
    records = []
    for i, (r, d, (a, _), n) in enumerate(zip(rows, drafts, verdicts, old_lens)):
        r.out.emit_times.append(t3 - t_start - r.out.submitted_s)
        if r not in still:
            drafter.release(r.slot)
        records.append(dict(cycle=index, row=r.req, drafted=len(d), accepted=a, emitted=len(r.seq) - n, kv_len=n - 1,
                            batch_rows=len(rows), t_draft=t1 - t0, t_verify=t2 - t1, t_other=t3 - t2))
        if prop.sources:
            records[-1]["draft_source"] = prop.sources[i]
    return still, records


@torch.inference_mode()
def generate(
    model: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    sp: SamplingParams,
    drafter: Drafter | None = None,
    eos_ids: tuple[int, ...] = (),
    gen: torch.Generator | None = None,
    trace: bool = True,
):
    """Generate for a static batch of prompts (row b in KV slot b). Returns (rows, cycles, wall):
    one RowOutput per prompt, when trace one dict per (cycle, active row) with drafted / accepted /
    emitted counts, the row's KV length and the cycle's t_draft / t_verify / t_other (shared by
    the rows of the cycle), and the seconds from the first prefill to the end."""
    drafter = NoDrafter() if drafter is None else drafter
    dev = model.device
    setup(model, drafter, len(prompts), max_len_for(prompts, max_new_tokens, drafter))
    rows = [Row(b, b, list(p), RowOutput(list(p))) for b, p in enumerate(prompts)]
    cycles: list[dict] = []
    t_start = _clock(dev)
    # Prefill row by row (no padding), then cycle over the rows that go on until none does.
    active = [r for r in rows if prefill(model, drafter, r, sp, gen, max_new_tokens, eos_ids, t_start)]
    n = 0
    while active:
        active, records = cycle(model, drafter, active, sp, gen, max_new_tokens, eos_ids, t_start, n)
        if trace:
            cycles += records
        n += 1
    return [r.out for r in rows], cycles, _clock(dev) - t_start


@torch.inference_mode()
def margins_across_shapes(model: Target, prefix: list[int], preferred: int, other: int, shapes: list[int]) -> list[float]:
    """logit(preferred) - logit(other) as the next token after prefix (= log p difference), one
    row in cache slot 0, per shape: n, the prefix's start forwarded first and its last n tokens in
    one forward (as a verify carries them); 0, the whole prefix as the engine prefills a prompt
    (NativeBackend.margins_across_shapes; the lossless check's probe, never inside a timed run).
    Whatever is forwarded without its logits goes in the engine's prefill pieces, so a probe
    past a long prompt holds piece x context attention scores, not context x context."""
    dev, L = model.device, len(prefix)
    model.setup_cache(1, L + 1)  # a larger cache already there is kept (engine.setup does the same)
    slot, out = torch.tensor([0], device=dev), []
    chunk = getattr(model, "prefill_chunk_tokens", None)
    for n in shapes:
        n = min(n, L) if n else L - prefill_pieces(L, chunk)[-1][0]  # 0: the engine's last prefill piece
        head, tail = prefix[: L - n], prefix[L - n:]
        model.rollback(0, 0)
        write_kv(model, head, 0, 0)
        toks = torch.tensor([tail], device=dev)
        last = torch.zeros_like(toks, dtype=torch.bool)
        last[0, -1] = True
        logits = model(toks, (len(head) + torch.arange(n, device=dev))[None], rows=slot, logits_for=last)[-1].float()
        out.append(float(logits[preferred] - logits[other]))
    return out
