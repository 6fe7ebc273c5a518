"""The target's exact distribution over short continuations, for the chi-square tests of
speculative sampling (imported by tests; pytest puts tests/ on sys.path)."""
import torch

from backends.native.sampling import probs_from_logits


def next_token_probs(model, seq, sp):
    """p(next token | seq) under the sampling settings sp, from one full forward."""
    model.setup_cache(1, 64)
    with torch.inference_mode():
        lg = model(torch.tensor([seq]), torch.arange(len(seq))[None])[0, -1:]
    return probs_from_logits(lg, sp)[0]


def exact_three_tokens(model, prompt, sp) -> dict:
    """p(t1, t2, t3 | prompt) for every continuation with non-zero probability."""
    exact = {}
    p1 = next_token_probs(model, prompt, sp)
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = next_token_probs(model, prompt + [t1], sp)
        for t2 in torch.nonzero(p2).flatten().tolist():
            p3 = next_token_probs(model, prompt + [t1, t2], sp)
            for t3 in torch.nonzero(p3).flatten().tolist():
                exact[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    return exact
