"""Reading JSON Lines files, with errors that name the file and the line."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def read_jsonl(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, object]]:
    """(line number, parsed object) for every non-blank line; a line that is not UTF-8 or not JSON
    raises `error` naming the file, the line and the column (the byte, for an encoding error)."""
    with Path(path).open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a BOM before the first line is allowed
            except UnicodeDecodeError as e:
                raise error(f"{path}, line {n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                            "JSON Lines files are UTF-8 text") from None
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}, line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
