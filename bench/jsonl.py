"""Reading JSON Lines files, with errors that name the line."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def read_jsonl(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, object]]:
    """(line number, parsed object) for every non-blank line; bad JSON raises `error` naming the
    file, the line and the column."""
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}, line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
