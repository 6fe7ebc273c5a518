"""Token selection and speculative verification (greedy and rejection sampling).

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): a draft token x drawn from q is
accepted with probability min(1, p(x) / q(x)); on rejection the target's token is drawn from
max(0, p - q) renormalized. Deterministic drafters (n-gram) propose one-hot q, so acceptance is
p(x) and the residual is p with x removed. The output then follows p exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: Tensor, sp: SamplingParams) -> Tensor:
    """[N, V] logits -> [N, V] probabilities after temperature, top-k and top-p."""
    logits = logits.float() / sp.temperature
    if sp.top_k and sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= sp.top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def select(logits: Tensor, sp: SamplingParams, gen: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
    """Pick one token per row: [N, V] -> ([N] tokens, [N, V] probs or None when greedy)."""
    if sp.greedy:
        return logits.argmax(-1), None
    probs = probs_from_logits(logits, sp)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1), probs


def accepted_prefix(draft: Tensor, target: Tensor, valid: Tensor | None = None) -> Tensor:
    """Greedy acceptance, batched and on the draft's device: per row, how many leading draft
    tokens equal the target's own choice. draft: [B, K]; target: [B, K + 1] token ids, column i
    the target's token after draft[:, :i]; valid: [B, K], False past a row's own draft."""
    match = draft == target[:, :-1]
    if valid is not None:
        match &= valid
    return match.long().cumprod(-1).sum(-1)


def verify(
    draft: list[int], q: Tensor | None, target_logits: Tensor, sp: SamplingParams, gen: torch.Generator | None
) -> tuple[int, int]:
    """Verify one row's draft. target_logits: [len(draft) + 1, V], row i predicts the token after
    draft[:i]. q: [len(draft), V] draft probabilities, or None for a deterministic proposal.
    Returns (accepted count, the target's own next token)."""
    if sp.greedy:
        target = target_logits.argmax(-1)
        a = int(accepted_prefix(torch.tensor([draft], dtype=torch.long, device=target.device), target[None])[0])
        return a, int(target[a])
    p = probs_from_logits(target_logits, sp)
    return rejection_sample(draft, q, p, gen)


def rejection_sample(draft: list[int], q: Tensor | None, p: Tensor, gen: torch.Generator | None) -> tuple[int, int]:
    """draft: k tokens; q: [k, V] or None (one-hot); p: [k + 1, V] target probabilities."""
    if draft:
        idx = torch.arange(len(draft))
        d = torch.tensor(draft)
        p_d = p[idx, d]
        q_d = q[idx, d] if q is not None else torch.ones(len(draft))
        u = torch.rand(len(draft), generator=gen)
        accept = u < torch.clamp(p_d / q_d, max=1.0)
        rejected = (~accept).nonzero()
        if len(rejected):
            i = int(rejected[0])
            if q is not None:
                residual = torch.clamp(p[i] - q[i], min=0.0)
            else:
                residual = p[i].clone()
                residual[draft[i]] = 0.0
            total = residual.sum()
            # p == q up to rounding: any token of p is a correct draw.
            residual = residual / total if total > 0 else p[i]
            return i, int(torch.multinomial(residual, 1, generator=gen))
    k = len(draft)
    return k, int(torch.multinomial(p[k], 1, generator=gen))
