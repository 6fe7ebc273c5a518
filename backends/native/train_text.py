"""Offline text for training draft heads by teacher forcing (`specsweep-train-eagle --data text`).

A head learns to agree with the target's own next-token choice given the target's features. Those
can come from one target pass over any text (teacher forcing): no token has to be generated, so a
CPU-hour yields several times more training positions than greedy generation does. The text is what
every Python install has, in three kinds, interleaved so that each stretch of the data mixes them:
- code: the standard library's modules (the code workloads' language);
- docs: the language reference (pydoc_data.topics): prose about code;
- prose: the descriptions (README text) of the installed packages, from their METADATA files.
Any chunk that shares a line with a prompt a sweep measures is dropped (held out), so a head is
never scored on text it was trained on.
"""
from __future__ import annotations

import random
import sysconfig
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

MIN_HELD_OUT_LINE = 24  # characters: shorter lines ("return x", "}") are too common to mark a prompt's text
CHARS_PER_TOKEN_CUT = 4  # a chunk is cut after chunk_tokens x this many characters, then trimmed to chunk_tokens
MIN_CHUNK_TOKENS = 32  # a shorter chunk (a document's tail) is not worth a target pass


def _stdlib_modules() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        try:
            out.append(f"# File: {path.relative_to(root)}\n{path.read_text(encoding='utf-8')}")
        except (UnicodeDecodeError, OSError):
            continue
    return out


def _reference_topics() -> list[str]:
    from pydoc_data.topics import topics

    return [text for _, text in sorted(topics.items()) if len(text) > 400]


def _package_descriptions() -> list[str]:
    out = {}
    for dist in metadata.distributions():
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
        body = body or dist.metadata.get("Description") or ""
        name = dist.metadata.get("Name") or ""
        if len(body) > 400 and name.lower() not in out:
            out[name.lower()] = body
    return [out[k] for k in sorted(out)]


def documents(seed: int) -> dict[str, list[str]]:
    """Every document by kind (code, docs, prose), each kind in a seeded order."""
    rng = random.Random(seed)
    kinds = {"code": _stdlib_modules(), "docs": _reference_topics(), "prose": _package_descriptions()}
    for docs in kinds.values():
        rng.shuffle(docs)
    return kinds


def held_out_lines(prompts: list[str]) -> set[str]:
    """The lines that mark a measured prompt's text (stripped, long enough to be specific)."""
    return {s for p in prompts for s in (line.strip() for line in p.splitlines()) if len(s) >= MIN_HELD_OUT_LINE}


def _pieces(docs: list[str], chars: int) -> Iterator[str]:
    """Consecutive pieces of the documents, each cut at the first line end past `chars` characters."""
    for text in docs:
        piece: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            piece.append(line)
            size += len(line)
            if size >= chars:
                yield "".join(piece)
                piece, size = [], 0
        if piece:
            yield "".join(piece)


def chunks(kinds: dict[str, list[str]], encode, chunk_tokens: int, held_out: set[str],
           start: int = 0) -> Iterator[tuple[int, str, list[int]]]:
    """(index, kind, token ids) of chunks of at most chunk_tokens tokens, taken from the kinds in
    turn (one chunk of each, so every stretch of the data mixes code, docs and prose whatever
    their documents' lengths) until every kind is used up; a chunk with a held-out line, or too
    short, is skipped. index counts every chunk cut, kept or not, so a resumed run passes `start`
    and continues where the last one stopped."""
    streams = {k: _pieces(docs, chunk_tokens * CHARS_PER_TOKEN_CUT) for k, docs in kinds.items()}
    index = 0
    while streams:
        for kind in list(streams):
            piece = next(streams[kind], None)
            if piece is None:
                del streams[kind]
                continue
            if index >= start and not any(line.strip() in held_out for line in piece.splitlines()):
                ids = encode(piece)[:chunk_tokens]
                if len(ids) >= MIN_CHUNK_TOKENS:
                    yield index, kind, ids
            index += 1


RANKING_CHARS_PER_KIND = 2_000_000  # about 600k tokens of code and of reference prose: a stable ranking in ~3 s


def token_ranking(encode, vocab_size: int, first: tuple[int, ...] = ()) -> list[int]:
    """Every token id, most frequent first in the standard library's modules and the language
    reference (the first RANKING_CHARS_PER_KIND characters of each, in a fixed order; the installed
    packages' descriptions are left out, so the ranking is the same wherever the Python version
    is), ids in `first` (end-of-turn tokens) ahead of all, ties by the lower id. A draft vocabulary
    of the first N ids of this ranking (method.draft_vocab_from=text) covers the ids a model
    writes far better than its first N token ids: Gemma keeps digits and punctuation at the end
    of its vocabulary."""
    import numpy as np

    counts = np.zeros(vocab_size, dtype=np.int64)
    for docs in (_stdlib_modules(), _reference_topics()):
        used = 0
        for text in docs:
            ids = np.asarray(encode(text), dtype=np.int64)
            counts += np.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
            used += len(text)
            if used >= RANKING_CHARS_PER_KIND:
                break
    lead = [i for i in dict.fromkeys(first) if 0 <= i < vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count, then the lower id
    return lead + order[~np.isin(order, lead)].tolist()
