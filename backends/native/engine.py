"""The draft/verify loop. One function serves the baseline (no drafter: every cycle is a plain
decode step, through the same code) and every speculative method, for a ragged batch."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .model import Transformer
from .sampling import SamplingParams, select, verify


@dataclass
class RowOutput:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # target top-2 logit margin per token (if asked)
    ttft_s: float = 0.0
    emit_times: list[float] = field(default_factory=list)  # seconds since batch start, per cycle that emitted
    finished_by: str = "length"


def _clock(device) -> float:
    # Timing boundaries synchronize on accelerators, as Spec-Bench does.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _top2_margin(logits: torch.Tensor) -> list[float]:
    top = torch.topk(logits.float(), 2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    sp: SamplingParams,
    drafter=None,
    eos_ids: tuple[int, ...] = (),
    gen: torch.Generator | None = None,
    record_margins: bool = False,
    trace: bool = True,
):
    """Generate for a batch of prompts. Returns (rows, cycles): one RowOutput per prompt and,
    when trace, one dict per (cycle, active row) with drafted/accepted/emitted counts, the row's
    KV length and the cycle's t_draft / t_verify / t_other (shared by the rows of the cycle)."""
    dev = model.embed.weight.device
    k = getattr(drafter, "k", 0)
    B = len(prompts)
    max_len = max(len(p) for p in prompts) + max_new_tokens + k + 2
    if model.max_batch < B or model.max_len < max_len:
        model.setup_cache(max(B, model.max_batch), max(max_len, model.max_len))
    if drafter is not None and hasattr(drafter, "setup"):
        drafter.setup(B, max_len)
    capture = getattr(drafter, "capture", None)  # feature-based heads read the target's hidden states
    out = [RowOutput(list(p)) for p in prompts]
    seqs = [list(p) for p in prompts]  # prompt + generated; the last token is not yet in the cache
    cycles: list[dict] = []
    t_start = _clock(dev)

    # Prefill row by row (no padding), then pick each row's first token.
    for b, p in enumerate(prompts):
        toks = torch.tensor([p], device=dev)
        last = torch.zeros_like(toks, dtype=torch.bool)
        last[0, -1] = True
        feats = None
        logits = model(toks, torch.arange(len(p), device=dev)[None], rows=torch.tensor([b], device=dev), logits_for=last,
                       capture=capture)
        if capture:
            logits, feats = logits
        tok, _ = select(logits, sp, gen)
        if drafter is not None:
            drafter.prefill(b, p, None if feats is None else feats[0])
        seqs[b].append(int(tok))
        out[b].tokens.append(int(tok))
        if record_margins:
            out[b].margins += _top2_margin(logits)
        out[b].ttft_s = _clock(dev) - t_start
        out[b].emit_times.append(out[b].ttft_s)
        if int(tok) in eos_ids:
            out[b].finished_by = "eos"
    active = [b for b in range(B) if len(out[b].tokens) < max_new_tokens and out[b].finished_by != "eos"]

    cycle = 0
    while active:
        t0 = _clock(dev)
        if drafter is not None:
            prop = drafter.propose(active, [seqs[b] for b in active], sp, gen)
            drafts, qs, sources = prop.tokens, prop.probs, prop.sources
        else:
            drafts, qs, sources = [[] for _ in active], [None] * len(active), None
        t1 = _clock(dev)
        K = max(len(d) for d in drafts)
        toks, pos, need = [], [], []
        for b, d in zip(active, drafts):
            n = len(seqs[b])
            row = [seqs[b][-1]] + d
            need.append([True] * len(row) + [False] * (K + 1 - len(row)))
            toks.append(row + [row[-1]] * (K + 1 - len(row)))  # padding: its slots lie beyond the row
            pos.append(list(range(n - 1, n + K)))
        need_t = torch.tensor(need, device=dev)
        logits = model(torch.tensor(toks, device=dev), torch.tensor(pos, device=dev),
                       rows=torch.tensor(active, device=dev), logits_for=need_t, capture=capture)
        feats = None
        if capture:
            logits, feats = logits
        t2 = _clock(dev)
        logits = logits.float().cpu() if logits.device.type != "cpu" else logits
        per_row = torch.split(logits, [len(d) + 1 for d in drafts])
        old_lens, accepted = [], []
        still = []
        emitted_counts = []
        for b, d, q, lg in zip(active, drafts, qs, per_row):
            a, nxt = verify(d, q, lg, sp, gen)
            old_lens.append(len(seqs[b]))
            accepted.append(a)
            new = d[:a] + [nxt]
            if record_margins:
                margins = _top2_margin(lg[: a + 1])
            room = max_new_tokens - len(out[b].tokens)
            new = new[:room]
            for i, t in enumerate(new):
                if t in eos_ids:
                    new = new[: i + 1]
                    out[b].finished_by = "eos"
                    break
            seqs[b] += new
            out[b].tokens += new
            if record_margins:
                out[b].margins += margins[: len(new)]
            emitted_counts.append(len(new))
            if out[b].finished_by != "eos" and len(out[b].tokens) < max_new_tokens:
                still.append(b)
        if drafter is not None:
            drafter.accepted(active, old_lens, accepted, feats)
        t3 = _clock(dev)
        for b, n_emit in zip(active, emitted_counts):
            out[b].emit_times.append(t3 - t_start)
            if b not in still and drafter is not None:
                drafter.release(b)
        if trace:
            for i, (b, d, a, n_emit, n) in enumerate(zip(active, drafts, accepted, emitted_counts, old_lens)):
                cycles.append(dict(cycle=cycle, row=b, drafted=len(d), accepted=a, emitted=n_emit, kv_len=n - 1,
                                   batch_rows=len(active), t_draft=t1 - t0, t_verify=t2 - t1, t_other=t3 - t2))
                if sources:
                    cycles[-1]["draft_source"] = sources[i]
        active = still
        cycle += 1
    return out, cycles, _clock(dev) - t_start
