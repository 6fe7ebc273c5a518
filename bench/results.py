"""The results store: one folder per job, atomic writes, and the sweep's index table.

results/<sweep_name>/<job>/         config.yaml, summary.json, requests.parquet, cycles.parquet
results/<sweep_name>/baselines/<key>/  a shared baseline measurement, reused by every method
results/<sweep_name>/index.parquet, index.csv   one row per job (its summary)
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

import pandas as pd

from .backend import file_lock

COMPLETE_STATUSES = ("ok", "skipped")
# statuses that fail a sweep (exit 1) and a gate; partial: measured under load with failed requests
FAILED_STATUSES = ("error", "timeout", "partial")


def _file_identity(path: Path) -> str:
    """A file or folder named by what it is, not where it lies: its name and size (a folder: each
    file's relative name and size), so the same head or model copied elsewhere keys alike."""
    if path.is_dir():
        files = sorted((str(f.relative_to(path)), f.stat().st_size) for f in path.rglob("*") if f.is_file())
        return f"{path.name}:{short_hash(files)}"
    return f"{path.name}:{path.stat().st_size}"


def _portable(group: dict) -> dict:
    """A config group with each `path` / `*_path` that names an existing file or folder replaced by
    its identity (_file_identity): two machines, or two checkouts, that hold the same model or head
    at other paths give a job the same key, so a gate baseline recorded on one matches the other."""
    out = {}
    for k, v in dict(group).items():
        if (k == "path" or str(k).endswith("_path")) and isinstance(v, str) and v and Path(v).exists():
            v = _file_identity(Path(v))
        out[k] = v
    return out


@dataclass(frozen=True)
class JobKey:
    """What identifies a job, once, for the runner (the row's identity columns), the results index,
    the gate (its job keys) and the report: the names of backend, model, method and workload,
    every sweep setting that changes what is measured, and `config_hash`, a digest of the four
    configs' other values (a method's knobs, a backend's dtype), so that two jobs that differ
    anywhere never share a key."""
    backend: str
    model: str
    method: str
    workload: str
    batch_size: int
    temperature: float
    top_p: float
    top_k: int
    num_speculative_tokens: int
    max_new_tokens: int
    num_prompts: int
    seed: int
    config_hash: str | None = None  # None in rows written before it existed

    @classmethod
    def from_config(cls, c: dict) -> "JobKey":
        groups = ("backend", "model", "method", "workload")
        hashed = {g: _portable(c[g]) for g in groups}
        if (c.get("load") or {}).get("kind", "static") != "static":  # static jobs keep the keys they had
            hashed["load"] = c["load"]
        if c.get("aa_control"):  # an A/A control is not the method's own job (other jobs keep their keys)
            hashed["aa_control"] = True
        for key in ("prompt_tokens", "ignore_eos"):  # likewise a set input length, outputs past EOS
            if c.get(key):
                hashed[key] = c[key]
        return cls(*(c[g]["name"] for g in groups), *(c[f.name] for f in fields(cls)[4:-1]),
                   config_hash=short_hash(hashed))

    @classmethod
    def from_row(cls, row) -> "JobKey":
        """From a summary row; a row missing an identity field is a ValueError naming it."""
        missing = [f.name for f in fields(cls)[:-1] if row.get(f.name) is None]
        if missing:
            raise ValueError(f"a result row has no {', '.join(missing)}")
        get = lambda f: row.get(f.name)  # noqa: E731
        return cls(*(str(get(f)) for f in fields(cls)[:4]), int(get(fields(cls)[4])), float(get(fields(cls)[5])),
                   float(get(fields(cls)[6])), *(int(get(f)) for f in fields(cls)[7:-1]), config_hash=row.get("config_hash"))

    def label(self) -> str:
        return (f"{self.backend}/{self.model}/{self.method}/{self.workload}/b{self.batch_size}/t{self.temperature:g}"
                f"/k{self.num_speculative_tokens}/n{self.max_new_tokens}/p{self.num_prompts}/s{self.seed}"
                f"/topp{self.top_p:g}/topk{self.top_k}/{self.config_hash or '-'}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() would give: mkstemp's 0600 would shut out a shared file system's group


def atomic_write(path: Path, write) -> None:
    """write(tmp_path) then rename over path: a crash never leaves a half-written file. The file
    gets the user's umask, as any file the user writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _clean(obj):
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item"):  # numpy scalars
        return _clean(obj.item())
    return obj


def write_json(path: Path, obj) -> None:
    atomic_write(path, lambda p: p.write_text(json.dumps(_clean(obj), indent=1, sort_keys=False)))


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def write_parquet(path: Path, df: pd.DataFrame) -> None:
    atomic_write(path, lambda p: df.to_parquet(p, index=False))


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text))


def short_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:10]


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def job_name(cfg: dict) -> str:
    """A stable, readable folder name for a job, plus a hash of everything that defines it."""
    m = cfg["method"]
    load = cfg.get("load") or {"kind": "static"}
    size = f"b{cfg['batch_size']}" if load["kind"] == "static" else ("c" if load["kind"] == "concurrency" else "r") + _num(load["level"])
    parts = [cfg["backend"]["name"], cfg["model"]["name"], m["name"], cfg["workload"]["name"], size,
             f"t{_num(cfg['temperature'])}"]
    if m.get("speculative", True):
        parts.append(f"k{cfg['num_speculative_tokens']}")
    if cfg.get("prompt_tokens"):
        parts.append(f"in{cfg['prompt_tokens']}")
    if cfg.get("aa_control"):
        parts.append("aa")
    return "-".join(parts) + "-" + short_hash(job_identity(cfg))


def job_identity(cfg: dict) -> dict:
    """What defines a job's measurement (not where it is written or whether it is forced)."""
    # slo changes no measurement, only which requests goodput counts (requests.parquet keeps them all)
    drop = {"results_dir", "sweep_name", "force", "report", "job_timeout_s", "slo"}
    if (cfg.get("load") or {}).get("kind", "static") == "static":
        drop.add("load")  # static jobs keep the identity (and folder names) they had
    if not cfg.get("aa_control"):
        drop.add("aa_control")  # likewise every job that is not an A/A control
    for key in ("prompt_tokens", "ignore_eos"):  # and every job at its workload's own lengths
        if not cfg.get(key):
            drop.add(key)
    return {k: v for k, v in cfg.items() if k not in drop}


def baseline_identity(cfg: dict, engine_key: dict | None = None) -> dict:
    """What a baseline depends on: everything but the method and its draft length, plus what the
    engine declares of the method that changes its baseline path (Backend.baseline_key)."""
    ident = job_identity(cfg)
    for k in ("method", "num_speculative_tokens", "baseline", "lossless_margin_tol", "aa_control"):
        ident.pop(k, None)
    if engine_key:
        ident["engine_baseline"] = engine_key
    return ident


MANIFEST = "manifest.json"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path, names) -> None:
    """Written last: the size and hash of every file a job (or shared baseline) wrote. A folder is
    complete only when its manifest exists and every file in it still matches."""
    folder = Path(folder)
    files = {n: {"size": (folder / n).stat().st_size, "sha256": _digest(folder / n)} for n in names if (folder / n).exists()}
    write_json(folder / MANIFEST, {"files": files})


def incomplete_reason(folder: Path) -> str | None:
    """None if the folder's manifest and every file it names check out, else why not."""
    folder = Path(folder)
    try:
        files = read_json(folder / MANIFEST)["files"]
    except FileNotFoundError:
        return "no manifest (the run that wrote it did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest is unreadable ({type(e).__name__})"
    for name, want in files.items():
        p = folder / name
        if not p.exists():
            return f"{name} is missing"
        if p.stat().st_size != want["size"] or _digest(p) != want["sha256"]:
            return f"{name} changed or is truncated since it was written"
    return None


def is_complete(job_dir: Path) -> bool:
    s = Path(job_dir) / "summary.json"
    if not s.exists():
        return False
    try:
        row = read_json(s)
    except (json.JSONDecodeError, OSError, UnicodeDecodeError):
        return False
    # a status that counts as done, and every file the job wrote as it was written
    return isinstance(row, dict) and row.get("status") in COMPLETE_STATUSES and incomplete_reason(job_dir) is None


def load_summaries(sweep_dir: Path, strict: bool = False) -> pd.DataFrame:
    """Every job's summary row. An unreadable one (not JSON, not an object) is left out, or, with
    strict (the gate), a ValueError naming the file."""
    rows = []
    for s in sorted(Path(sweep_dir).glob("*/summary.json")):
        try:
            row = read_json(s)
            if not isinstance(row, dict):
                raise ValueError(f"a JSON {type(row).__name__}, not an object")
        except (json.JSONDecodeError, OSError, UnicodeDecodeError, ValueError) as e:
            if strict:
                raise ValueError(f"{s}: not a job summary ({e})") from None
            continue
        row["job_dir"] = s.parent.name
        rows.append(row)
    return pd.DataFrame(rows)


def build_index(sweep_dir: Path) -> pd.DataFrame:
    """Gather every job's summary into index.parquet and index.csv (under a lock)."""
    sweep_dir = Path(sweep_dir)
    with file_lock(sweep_dir / ".index.lock"):
        df = load_summaries(sweep_dir)
        if df.empty:
            return df
        flat = df.copy()
        for col in flat.columns:  # nested values (per-position lists, env dicts) as JSON text
            if flat[col].map(lambda v: isinstance(v, (list, dict))).any():
                flat[col] = flat[col].map(lambda v: json.dumps(v) if isinstance(v, (list, dict)) else v)
        write_parquet(sweep_dir / "index.parquet", flat)
        atomic_write(sweep_dir / "index.csv", lambda p: flat.to_csv(p, index=False))
        return df


def find_sweep_dirs(path: Path) -> list[Path]:
    """A sweep folder (holding job folders), or a results root holding sweep folders."""
    path = Path(path)
    if any(path.glob("*/summary.json")):
        return [path]
    return sorted(p for p in path.iterdir() if p.is_dir() and any(p.glob("*/summary.json"))) if path.is_dir() else []
