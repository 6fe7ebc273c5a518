"""A draft model derived from a GGUF target, for llama.cpp's draft_model with no draft_path: the
target's first N layers and its own embedding, final norm and output head, written as a GGUF of its
own (an untrained early exit; the same draft the native engine derives for draft_model).

llama.cpp wants a draft model as a file sharing the target's vocabulary; a smaller model of the
same family is the usual choice, but Gemma 3 270M has none. The file is written once per target and
layer count into SPECSWEEP_CACHE/drafts, keyed on the target's size and modification time, the
quantized tensors copied byte for byte (nothing is re-quantized), and reused afterwards.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from bench.backend import file_lock

from .cpu_probe import cache_root

_LAYER = re.compile(r"^blk\.(\d+)\.")


def check_draft_layers(target: Path, n_layers: int) -> None:
    """A clear error, before any model loads, for a layer count the target cannot give."""
    from .model_facts import model_facts  # cached: the gguf reader's walk of the tokenizer takes seconds

    total = model_facts(target).n_layers
    if not 1 <= n_layers < total:
        raise ValueError(f"method.draft_layers={n_layers} cannot derive a draft from {target.name}: it has "
                         f"{total} layers; valid: 1 to {total - 1} (or give method.draft_path=FILE.gguf)")


def derived_draft_path(target: Path, n_layers: int) -> Path:
    """Where the draft of `target`'s first n_layers layers lives (written by derive_draft)."""
    target = target.resolve()  # a link to the same file shares its draft
    st = target.stat()
    return cache_root() / "drafts" / f"{target.stem}-{st.st_size:x}-{int(st.st_mtime):x}-first{n_layers}.gguf"


def derive_draft(target: Path, n_layers: int) -> Path:
    """The draft GGUF for `target` cut to its first n_layers layers, written if not there yet."""
    check_draft_layers(target, n_layers)
    out = derived_draft_path(target, n_layers)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Two processes wanting the same draft (parallel sweeps, test workers) write it once: the
    # second waits for the first's lock, then finds the file.
    with file_lock(out.with_suffix(".lock")):
        if out.is_file():
            return out
        _write_draft(target, n_layers, out)
    return out


def _write_draft(target: Path, n_layers: int, out: Path) -> None:
    import gguf

    print(f"specsweep: deriving a draft from {target.name}'s first {n_layers} layers into {out} (once; "
          "about half a minute on 2 cores)", file=sys.stderr, flush=True)
    reader = gguf.GGUFReader(str(target))
    arch = reader.get_field("general.architecture").contents()
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        # the header's own fields are written by the writer; the architecture key was given above
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.name"):
            continue
        value = n_layers if field.name == f"{arch}.block_count" else field.contents()
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub_type)
    writer.add_string("general.name", f"first {n_layers} layers of {target.stem} (specsweep-derived draft)")
    kept = [t for t in reader.tensors
            if not (m := _LAYER.match(t.name)) or int(m.group(1)) < n_layers]
    for t in kept:
        # the reader gives a quantized tensor as its rows of bytes, from which the writer recovers the shape
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)  # whole or absent: a second job never reads a half-written draft
