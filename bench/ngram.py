"""Prompt lookup, defined once: used by the native engine's n-gram drafter and by the trace
builder, which replays it over finished generations."""
from __future__ import annotations

import numpy as np


def ngram_lookup(seq, k: int, min_ngram: int = 1, max_ngram: int = 3, prefer_recent: bool = True,
                 min_hits: int = 1, with_match_len: bool = False):
    """Find an earlier occurrence of the context's last n tokens (n from max_ngram down to
    min_ngram) and return the up to k tokens that followed it. prefer_recent takes the latest
    match (llama.cpp's ngram-simple) rather than the earliest (transformers' prompt lookup);
    min_hits asks that the n-gram occurred at least that often. with_match_len: (tokens, n), n the
    length of the context suffix that matched (0: no match, no tokens)."""
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
        out = arr[start : start + k].tolist()
        return (out, n) if with_match_len else out
    return ([], 0) if with_match_len else []


def replay_lookup(seq, first: int, k: int, min_ngram: int = 1, max_ngram: int = 3, prefer_recent: bool = True,
                  min_hits: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ngram_lookup(seq[:L], k, ..., with_match_len=True) for every context length L = first ..
    len(seq), in one pass (the same results, a test checks it; ngram_lookup per position costs a
    scan of the whole context, this a dictionary step): arrays over L of where the proposal starts
    in seq, how many tokens it has (0: no match) and the match length n.

    For each n it keeps, per n-gram, its first and last start and its count among the n-grams
    that end before the context's last token (an occurrence with a continuation, as ngram_lookup
    counts them); the context's own suffix is then looked up in that table."""
    arr = [int(x) for x in seq]
    N = len(arr)
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"min_ngram={min_ngram}, max_ngram={max_ngram}: need 1 <= min_ngram <= max_ngram")
    if not 1 <= first <= N:
        raise ValueError(f"first={first}: the first context length must be in 1..{N}")
    ns = range(max_ngram, min_ngram - 1, -1)
    seen: dict[int, dict[tuple, list[int]]] = {n: {} for n in ns}  # n -> n-gram -> [first start, last start, count]
    out_start = np.zeros(N - first + 1, dtype=np.int64)
    out_len = np.zeros(N - first + 1, dtype=np.int64)
    out_n = np.zeros(N - first + 1, dtype=np.int64)

    def add(n, s):
        key = tuple(arr[s : s + n])
        e = seen[n].get(key)
        if e is None:
            seen[n][key] = [s, s, 1]
        else:
            e[1], e[2] = s, e[2] + 1

    for L in range(1, N + 1):
        for n in ns:  # the n-gram ending at L - 2 is now an occurrence with a continuation (token L - 1)
            if L - 1 - n >= 0:
                add(n, L - 1 - n)
        if L < first:
            continue
        j = L - first
        for n in ns:
            if n > L - 1:
                continue
            e = seen[n].get(tuple(arr[L - n : L]))
            if e is None or e[2] < max(min_hits, 1):
                continue
            start = (e[1] if prefer_recent else e[0]) + n
            out_start[j], out_len[j], out_n[j] = start, min(k, L - start), n
            break
    return out_start, out_len, out_n


def lookup_trace(prompt, generated, k: int, context_offset: int = 1, **knobs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The lookup replayed over a finished generation (replay_lookup), per generated position i (a
    cycle whose context is prompt + generated[:i + context_offset]): acc_len (tokens it would emit:
    its accepted proposal + 1, never past the end), draft_len (tokens proposed, 0 without a match)
    and match_len (the context suffix it matched, 0 without one). context_offset 1 is specsweep's
    traces' convention (position 0: the first cycle after prefill's token); 0 is the published
    SpecDecode-Bench traces' (their position 0 is the prefill itself, acc_len 1 in every trace)."""
    return lookup_alignments(prompt, generated, k, (context_offset,), **knobs)[context_offset]


def lookup_alignments(prompt, generated, k: int, offsets=(1, 0), **knobs) -> dict[int, tuple]:
    """lookup_trace for each context offset in offsets, from one replay of the lookup (the
    contexts of offset 0 are those of offset 1 and one more)."""
    for o in offsets:
        if o not in (0, 1):
            raise ValueError(f"context_offset={o}: use 1 (specsweep's traces) or 0 (the published ones)")
    seq = [int(x) for x in prompt] + [int(x) for x in generated]
    P, G = len(prompt), len(generated)
    out = {o: (np.ones(G, dtype=np.int64), np.zeros(G, dtype=np.int64), np.zeros(G, dtype=np.int64))
           for o in offsets if G == 0 or P + o < 1}  # nothing generated, or no context to look up in
    todo = [o for o in offsets if o not in out]
    if not todo:
        return out
    first = P + min(todo)
    start, drafted, matched = replay_lookup(seq, first, k, **knobs)  # contexts first .. P + G
    for o in todo:
        s = P + o - first  # the replay's entry for position 0 of this alignment
        acc = np.ones(G, dtype=np.int64)
        for i in range(G):
            end = P + i + o  # the context's length: drafts are checked against seq[end:]
            m = 0
            while m < drafted[s + i] and end + m < P + G and seq[start[s + i] + m] == seq[end + m]:
                m += 1
            acc[i] = min(m + 1, G - i)
        out[o] = (acc, drafted[s:s + G], matched[s:s + G])
    return out


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
