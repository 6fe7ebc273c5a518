"""Prompt lookup, defined once: used by the native engine's n-gram drafter and by the trace
builder, which replays it over finished generations."""
from __future__ import annotations

import numpy as np


def ngram_lookup(seq, k: int, min_ngram: int = 1, max_ngram: int = 3, prefer_recent: bool = True,
                 min_hits: int = 1) -> list[int]:
    """Find an earlier occurrence of the context's last n tokens (n from max_ngram down to
    min_ngram) and return the up to k tokens that followed it. prefer_recent takes the latest
    match (llama.cpp's ngram-simple) rather than the earliest (transformers' prompt lookup);
    min_hits asks that the n-gram occurred at least that often."""
    arr = np.asarray(seq, dtype=np.int64)
    L = len(arr)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = arr[L - n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)  # excludes the suffix itself
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < L]  # a continuation must exist
        if len(hits) < min_hits:
            continue
        start = int(hits[-1] if prefer_recent else hits[0]) + n
        return arr[start : start + k].tolist()
    return []


def acceptance_lengths_from_predictions(generated, predicted_next, k: int) -> np.ndarray:
    """acc_len[i] for a deterministic drafter whose greedy prediction of generated[t] given the
    true prefix is predicted_next[t] (teacher forcing). A cycle starting after generated[:i+1]
    accepts draft j only if drafts 1..j-1 were right, and then the drafter saw the true prefix,
    so acc_len[i] = 1 + the run of t = i+1, i+2, ... with predicted_next[t] == generated[t], at most
    k, and never past the end of the generation."""
    g = np.asarray(generated)
    ok = np.asarray(predicted_next) == g
    G = len(g)
    run = np.zeros(G + 1, dtype=np.int64)  # run[t] = consecutive matches starting at t
    for t in range(G - 1, -1, -1):
        run[t] = run[t + 1] + 1 if ok[t] else 0
    i = np.arange(G)
    matched = np.minimum(run[np.minimum(i + 1, G)], k)
    return np.minimum(matched + 1, G - i)


def acceptance_lengths_from_chains(generated, chains, k: int) -> np.ndarray:
    """acc_len[i] for a drafter whose k-token chain depends on its own earlier drafts (EAGLE
    heads): chains[t] holds the chain it drafts for generated[t], generated[t+1], ... when given
    the true prefix (and, on accepted steps, the true tokens, which an accepted chain holds).
    acc_len[i] = 1 + the leading matches of chains[i+1] against generated[i+1:], at most k, and
    never past the end of the generation."""
    g = np.asarray(generated)
    G = len(g)
    out = np.ones(G, dtype=np.int64)
    for i in range(G - 1):
        truth = g[i + 1 : i + 1 + k]
        c = np.asarray(chains[i + 1])[: len(truth)]
        miss = np.flatnonzero(c != truth)
        out[i] = 1 + (miss[0] if len(miss) else len(truth))
    return out
