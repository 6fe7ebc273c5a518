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
    len(seq), in one vectorized pass (the same results, a test checks it; ngram_lookup per position
    costs a scan of the whole context): arrays over L of where the proposal starts in seq, how many
    tokens it has (0: no match) and the match length n.

    Every n-gram of seq gets an id (the id of its first n - 1 tokens paired with its last token,
    numbered by np.unique), and its starts are sorted by id. The context of length L has as its
    suffix the n-gram starting at q = L - n, and the occurrences ngram_lookup counts there (those
    with a continuation inside the context) are exactly the starts before q with the same id: as
    many as q's rank among them, the first of them, and the one just before q."""
    arr = np.asarray(seq, dtype=np.int64).reshape(-1)
    N = len(arr)
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"min_ngram={min_ngram}, max_ngram={max_ngram}: need 1 <= min_ngram <= max_ngram")
    if not 1 <= first <= N:
        raise ValueError(f"first={first}: the first context length must be in 1..{N}")
    L = np.arange(first, N + 1)
    out_start = np.zeros(len(L), dtype=np.int64)
    out_len = np.zeros(len(L), dtype=np.int64)
    out_n = np.zeros(len(L), dtype=np.int64)
    tok = np.unique(arr, return_inverse=True)[1].astype(np.int64).reshape(-1)  # token ids renumbered below N
    ids = tok  # n = 1: the id of the n-gram starting at each s
    # n ascending (each n's ids come from the last's); a longer match overwrites a shorter one
    for n in range(1, min(max_ngram, N - 1) + 1):
        if n > 1:  # (id of the (n - 1)-gram at s, token s + n - 1) numbered again: ids stay below N
            ids = np.unique(ids[: N - n + 1] * (N + 1) + tok[n - 1:], return_inverse=True)[1].astype(np.int64).reshape(-1)
        if n < min_ngram:
            continue
        order = np.argsort(ids, kind="stable")  # starts grouped by id, ascending within a group
        sid = ids[order]
        new_group = np.ones(len(order), dtype=bool)
        new_group[1:] = sid[1:] != sid[:-1]
        group_first = np.maximum.accumulate(np.where(new_group, np.arange(len(order)), 0))
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order)) - group_first  # occurrences before each start
        earliest = np.empty(len(order), dtype=np.int64)
        earliest[order] = order[group_first]
        latest = np.empty(len(order), dtype=np.int64)
        latest[order] = np.concatenate(([0], order[:-1]))  # the start before, where rank >= 1
        q = L - n
        ok = q >= 1  # n <= L - 1
        qc = np.clip(q, 0, len(order) - 1)
        ok &= rank[qc] >= max(min_hits, 1)
        start = np.where(prefer_recent, latest[qc], earliest[qc]) + n
        out_start = np.where(ok, start, out_start)
        out_len = np.where(ok, np.minimum(k, L - start), out_len)
        out_n = np.where(ok, n, out_n)
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
    arr = np.asarray(seq, dtype=np.int64)
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
        i = np.arange(G)
        end = P + i + o  # each context's length: its drafts are checked against seq[end:]
        j = np.arange(k)[None, :]
        proposed, truth = start[s:s + G, None] + j, end[:, None] + j
        # draft j is accepted if drafts 0..j-1 were, it was proposed, and the generation reaches it
        hit = (j < drafted[s:s + G, None]) & (truth < P + G)
        hit &= arr[np.minimum(proposed, P + G - 1)] == arr[np.minimum(truth, P + G - 1)]
        m = np.cumprod(hit, axis=1).sum(axis=1)
        out[o] = (np.minimum(m + 1, G - i), drafted[s:s + G], matched[s:s + G])
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
