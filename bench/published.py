"""Measurements the docs quote, kept as data: a folder under docs/measurements/ holds a run's
index.csv (one row per job, the columns the docs read) and environment.json (the machine, its
load, the versions, the commands), and every figure a page quotes from it is written there by
`fill` from that data, between markers, so a page cannot disagree with its measurement.

  python -m bench.published record results/default --out docs/measurements/DATE-default-sweep \\
      --title "The default sweep" --command "specsweep"
  python -m bench.published fill README.md docs            # rewrite every marked figure
  python -m bench.published fill --check README.md docs    # exit 1 where a page drifted (a test runs this)

Markers (HTML comments: invisible on GitHub and in the site):

  <!-- table FOLDER COLUMN COLUMN ... [where KEY=VALUE ...] -->  ...  <!-- /table -->
      a markdown table of the folder's rows; COLUMN is a CSV column, `NAME:FORMAT` (a Python
      format spec: `speedup:.2f`, `verify_fraction:.0%`), or `NAME[ci]` (the value with its
      NAME_ci_low / NAME_ci_high interval: `speedup[ci]`).
  <!-- figure FOLDER COLUMN[:FORMAT] where KEY=VALUE ... -->  ...  <!-- /figure -->
      one value: the column of the one row that matches.
  <!-- machine FOLDER -->  ...  <!-- /machine -->
      the CPU, cores, load average and date the folder's run recorded.
  <!-- folders all -->  ...  <!-- /folders -->
      a list of every measurement folder: its title, date and machine (docs/measurements/index.md).

FOLDER is relative to docs/measurements/."""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
MEASUREMENTS = ROOT / "docs" / "measurements"

# The columns a recorded sweep keeps by default: what the README's and guides' tables read.
DEFAULT_COLUMNS = ["backend", "model", "method", "workload", "batch_size", "load_label", "temperature",
                   "num_speculative_tokens", "status", "speedup", "speedup_ci_low", "speedup_ci_high", "speedup_pairs",
                   "acceptance_rate", "mean_acceptance_length", "verify_fraction", "draft_fraction",
                   "baseline_roofline_share", "baseline_roofline_bound", "tpot_speedup", "tpot_speedup_ci_low",
                   "tpot_speedup_ci_high", "goodput_ratio", "lossless", "baseline_tokens_per_s", "tokens_per_s",
                   "speedup_baseline_first", "speedup_method_first", "pairs_baseline_first", "pairs_method_first",
                   "goodput_ratio_ci_low", "goodput_ratio_ci_high", "aa_control", "aa_verdict",
                   "threads", "loadavg_start", "loadavg_end", "prompt_tokens", "prompt_tokens_median", "max_new_tokens"]


def flat_buckets(df) -> list[str]:
    """The per-bucket dicts as plain columns a page's table can read, added to df, for each bucket
    a row reached: acceptance_<bucket> and speedup_<bucket> by output position (e.g.
    acceptance_256-1023), step_ms_<band> and verify_cost_<band> by context (e.g. step_ms_4096-16383).
    Returns their names."""
    import pandas as pd

    from bench.metrics.position import CONTEXT_BAND_EDGES, bucket_labels

    added = []
    for col, prefix, key, labels in (
            ("acceptance_by_output_bucket", "acceptance_", "acceptance_rate", bucket_labels()),
            ("speedup_by_output_bucket", "speedup_", None, bucket_labels()),
            ("cost_by_context", "step_ms_", "baseline_step_ms", bucket_labels(CONTEXT_BAND_EDGES)),
            ("cost_by_context", "verify_cost_", "verify_cost_ratio", bucket_labels(CONTEXT_BAND_EDGES))):
        if col not in df.columns:
            continue
        got = df[col].map(lambda v: v if isinstance(v, dict) else {})
        for b in [b for b in labels if any(b in d for d in got)]:
            vals = [d.get(b) for d in got]
            df[prefix + b] = pd.to_numeric([v.get(key) if isinstance(v, dict) else v for v in vals])
            added.append(prefix + b)
    return added

MARKER = re.compile(r"<!-- (table|figure|machine|folders) ([^>]*?) -->(.*?)<!-- /\1 -->", re.S)


class MarkerError(ValueError):
    """A marker that names a folder, column or row the data does not have."""


def record(sweep_dir: Path, out: Path, title: str, commands: list[str], note: str = "",
           columns: list[str] | None = None, plots: tuple[str, ...] = ()) -> Path:
    """Write OUT/index.csv (the sweep's rows, these columns), OUT/environment.json and OUT/index.md."""
    from bench.results import load_summaries

    df = load_summaries(Path(sweep_dir))
    if not len(df):
        raise SystemExit(f"{sweep_dir}: no complete job to record")
    for c in [c for c in columns or () if "." in c and c not in df.columns]:
        df[c] = [_config_value(Path(sweep_dir), job, c) for job in df["job"]]
    cols = [c for c in (columns or DEFAULT_COLUMNS) if c in df.columns] + flat_buckets(df)
    order = [c for c in ("backend", "method", "workload", "load_kind", "load_level", "batch_size", "prompt_tokens",
                         *[c for c in cols if "." in c], "num_speculative_tokens") if c in df.columns]
    first = df.iloc[0]
    write_folder(out, df.sort_values(order)[cols], title, commands, note, cpu=first.get("cpu"),
                 threads=sorted({int(t) for t in df.get("threads", []) if t == t}), loadavg_range=_load_range(df))
    for name in plots:
        src = Path(sweep_dir) / "report" / name
        if src.exists():
            (out / name).write_bytes(src.read_bytes())
    render(out)
    return out


def _config_value(sweep_dir: Path, job: str, dotted: str):
    """A job's setting (method.bits, backend.threads, ...) from the config.yaml in its folder, its
    value as the job ran (the method's default where the job did not set it), or None."""
    from omegaconf import OmegaConf

    from bench.methods import method_defaults

    path = sweep_dir / job / "config.yaml"
    if not path.exists():
        return None
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    group, _, key = dotted.partition(".")
    node = cfg.get(group) if isinstance(cfg.get(group), dict) else {}
    if key not in node and group == "method":
        node = {**method_defaults(node.get("name")), **node}
    return node.get(key)


def write_folder(out: Path, rows: pd.DataFrame, title: str, commands: list[str], note: str = "", cpu: str | None = None,
                 threads: list[int] | None = None, loadavg_range: list[float] | None = None) -> None:
    """A measurement folder's data: OUT/index.csv (these rows) and OUT/environment.json (the
    machine, its load, the versions, the commands; what is not given is read from this machine
    now). index.md is render()'s."""
    from bench.environment import snapshot

    out.mkdir(parents=True, exist_ok=True)
    rows.to_csv(out / "index.csv", index=False)
    env = snapshot()
    meta = {"title": title, "date": time.strftime("%Y-%m-%d"), "cpu": cpu or env["cpu"], "cpu_count": env["cpu_count"],
            "threads": threads or [], "loadavg_range": loadavg_range or [env["loadavg"][0], env["loadavg"][0]],
            "git_commit": env["git_commit"], "python": env["python"], "packages": env["packages"],
            "commands": commands, "note": note}
    (out / "environment.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")


def _load_range(df: pd.DataFrame) -> list[float] | None:
    """The lowest and highest one-minute load average the jobs saw at their start and end."""
    vals = [v[0] if isinstance(v, (list, tuple)) else v for c in ("loadavg_start", "loadavg_end") if c in df
            for v in df[c]]
    vals = [float(v) for v in vals if v is not None and v == v]
    return [min(vals), max(vals)] if vals else None


def _rows(folder: str) -> tuple[pd.DataFrame, dict]:
    path = MEASUREMENTS / folder
    if not (path / "index.csv").exists():
        known = sorted(p.name for p in MEASUREMENTS.iterdir() if (p / "index.csv").exists())
        raise MarkerError(f"measurement folder {folder!r} has no index.csv; known: {', '.join(known)}")
    env = json.loads((path / "environment.json").read_text()) if (path / "environment.json").exists() else {}
    return pd.read_csv(path / "index.csv"), env


def _select(df: pd.DataFrame, where: list[str], folder: str) -> pd.DataFrame:
    for cond in where:
        key, _, value = cond.partition("=")
        if key not in df.columns:
            raise MarkerError(f"{folder}: no column {key!r} to select on; columns: {', '.join(df.columns)}")
        col = df[key]
        if pd.api.types.is_numeric_dtype(col) and not pd.api.types.is_bool_dtype(col):
            df = df[col == float(value)]
        else:
            df = df[col.astype(str) == value]
    return df


def _cell(row, spec: str, folder: str) -> str:
    name, _, fmt = spec.partition(":")
    ci = name.endswith("[ci]")
    name = name[:-4] if ci else name
    if name not in row.index:
        raise MarkerError(f"{folder}: no column {name!r}; columns: {', '.join(row.index)}")
    v = row[name]
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if isinstance(v, (bool, np.bool_)):  # a CSV column of only "true" reads back as booleans
        return str(bool(v)).lower()
    fmt = fmt or (".2f" if isinstance(v, float) else "")
    text = format(v, fmt)
    if ci:
        lo, hi = row.get(f"{name}_ci_low"), row.get(f"{name}_ci_high")
        if lo == lo and hi == hi and lo is not None:
            text += f" [{format(lo, fmt)}, {format(hi, fmt)}]"
    return text


def _folder_line(path: Path) -> str:
    env = json.loads((path / "environment.json").read_text())
    title = env.get("title") or (path.name.split("-", 3)[-1].replace("-", " "))
    return f"- [{path.name}]({path.name}/index.md): {title}; {expand('machine', path.name)}"


def _split(args: str) -> tuple[str, list[str], list[str]]:
    words = shlex.split(args)
    if not words:
        raise MarkerError("a marker names no measurement folder")
    folder, rest = words[0], words[1:]
    where = rest[rest.index("where") + 1:] if "where" in rest else []
    cols = rest[:rest.index("where")] if "where" in rest else rest
    return folder, cols, where


def expand(kind: str, args: str, data: tuple | None = None) -> str:
    """The text a marker stands for, from its folder's data (or from `data`, (rows, environment),
    for a folder being rendered wherever it was written)."""
    if kind == "folders":
        return "\n" + "\n".join(_folder_line(p) for p in sorted(MEASUREMENTS.iterdir(), reverse=True)
                                if (p / "index.md").exists() and (p / "environment.json").exists()) + "\n"
    folder, cols, where = _split(args)
    df, env = data if data is not None else _rows(folder)
    if kind == "machine":
        span, start = env.get("loadavg_range"), env.get("loadavg_start")
        load = (f", load average {span[0]:g}-{span[1]:g}" if span else
                f", load average {start[0]:g} at the start" if isinstance(start, list) and start else "")
        return f"{env.get('cpu', '?')}, {env.get('cpu_count', '?')} cores, {env.get('date', '?')}{load}"
    rows = _select(df, where, folder)
    if kind == "figure":
        if len(rows) != 1 or len(cols) != 1:
            raise MarkerError(f"figure {args!r}: needs one column and a `where` that matches one row "
                              f"(matched {len(rows)})")
        return _cell(rows.iloc[0], cols[0], folder)
    if not len(rows):
        raise MarkerError(f"table {args!r}: no row matches")
    heads = [c.partition(":")[0].replace("[ci]", " [95%]") for c in cols]
    lines = ["", "| " + " | ".join(heads) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r, c, folder) for c in cols) + " |" for _, r in rows.iterrows()]
    return "\n".join(lines) + "\n"


def fill_text(text: str) -> str:
    def one(m):
        kind, args = m.group(1), m.group(2)
        return f"<!-- {kind} {args} -->{expand(kind, args)}<!-- /{kind} -->"
    return MARKER.sub(one, text)


def markdown_files(paths) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += sorted(p.rglob("*.md")) if p.is_dir() else [p]
    return out


def render(folder: Path) -> Path:
    """index.md of a recorded folder, from its index.csv and environment.json."""
    df = pd.read_csv(folder / "index.csv")
    env = json.loads((folder / "environment.json").read_text())
    name = folder.name
    def has(spec):  # a column some row holds a value in
        c = spec.split("[")[0].split(":")[0]
        return c in df.columns and df[c].notna().any() and not (df[c].astype(str) == "static").all()

    settings = [c for c in df.columns if "." in c]  # a job's settings recorded with --column method.KEY
    keys = [c for c in ("backend", "method", "workload", "batch_size", "load_label", "prompt_tokens", *settings,
                        "num_speculative_tokens")
            if has(c) and (df[c].nunique() > 1 or c in ("method", "workload", "load_label"))]
    cols = keys + [c for c in ("speedup[ci]", "tpot_speedup[ci]", "goodput_ratio", "acceptance_rate",
                               "mean_acceptance_length", "verify_fraction:.0%", "draft_fraction:.1%",
                               "baseline_roofline_share", "lossless", "aa_verdict") if has(c)]
    if not cols:  # not a sweep's rows (a benchmark's own figures): every column it recorded
        cols = [c for c in df.columns if has(c)]
    lines = [f"# {env.get('title', name)}, {env.get('date', '')}", "",
             f"Machine: <!-- machine {name} -->{expand('machine', name, (df, env))}<!-- /machine -->; commit "
             f"{env.get('git_commit')}.", "",
             f"<!-- table {name} {' '.join(cols)} -->{expand('table', name + ' ' + ' '.join(cols), (df, env))}<!-- /table -->",
             "",
             "Commands (from the repository root):", "", "```bash", *env.get("commands", []), "```", ""]
    if env.get("note"):
        lines += [env["note"], ""]
    lines += ["Data: [index.csv](index.csv) (every recorded column), [environment.json](environment.json).", ""]
    (folder / "index.md").write_text("\n".join(lines))
    return folder / "index.md"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.published", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="keep a sweep's rows and environment as a measurement folder")
    r.add_argument("sweep_dir", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--title", required=True)
    r.add_argument("--command", action="append", default=[], help="the command that made the sweep (repeatable)")
    r.add_argument("--note", default="")
    r.add_argument("--plot", action="append", default=[], help="a report plot to keep beside the data (repeatable)")
    r.add_argument("--column", action="append", default=[],
                   help="a row column to keep besides the default ones, e.g. verify_cost_ratio, or a job's "
                        "setting read from its config.yaml, e.g. method.bits (repeatable)")
    f = sub.add_parser("fill", help="rewrite the marked figures of markdown files from their data")
    f.add_argument("paths", nargs="+", type=Path, help="markdown files or folders")
    f.add_argument("--check", action="store_true", help="change nothing; exit 1 naming every page that drifted")
    a = ap.parse_args(argv)
    if a.cmd == "record":
        columns = DEFAULT_COLUMNS + [c for c in a.column if c not in DEFAULT_COLUMNS]
        print(record(a.sweep_dir, a.out, a.title, a.command, a.note, columns=columns, plots=tuple(a.plot)) / "index.md")
        return 0
    pages = {}
    for path in markdown_files(a.paths):
        try:
            pages[path] = fill_text(path.read_text())
        except MarkerError as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 2
    return sync_pages(pages, a.check, "differs from its data", "filled from its data")


def sync_pages(pages: dict[Path, str], check: bool, stale: str, written: str) -> int:
    """Generated pages: each path's text as it should be. Writes the ones that differ (check: writes
    nothing), names each, and returns the exit status (1 when checking found one that differs)."""
    differ = [path for path, text in pages.items() if not path.exists() or path.read_text() != text]
    for path in differ:
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(pages[path])
        print(f"{path}: {stale if check else written}")
    return 1 if check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
