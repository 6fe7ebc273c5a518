"""A soak: does a long sweep leave the sweep process where it started? Not a test: it runs for an
hour and measures this machine. Two phases, each one `specsweep` process sampled from outside
every few seconds (psutil: its resident memory, open file descriptors and threads; the engine
servers it starts are its children and are sampled apart):

  load  llama-server under a fixed arrival rate through specsweep for --minutes, then stopped
        with SIGTERM as a scheduler stops a job (jobs of --job-requests requests an arm, seeds
        0, 1, ... so each job sends new prompts; the server is started once and reused, as a
        sweep reuses it)
  jobs  --jobs small jobs in one sweep process (the native engine, the default model, one
        prompt of 8 tokens each: the per-job paths, not the decode loop)

  python benchmarks/soak.py --out docs/measurements/DATE-soak [--minutes 60] [--jobs 50]
  python benchmarks/soak.py --render docs/measurements/DATE-soak   # index.md from its data

The folder gets samples.csv (every sample, appended as it is taken: a soak cut short keeps what it
measured), index.csv (one row per phase: the first and last
minute's medians, the peak, and the growth) and environment.json; index.md is generated."""
from __future__ import annotations

import argparse
import math
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SAMPLE_S = 5.0
FIELDS = ["phase", "t_s", "rss_mib", "fds", "threads", "children", "children_rss_mib"]
RATE = 0.5  # requests/s: about a quarter of this 2-core machine's decode at 32 tokens a request


def load_phase(minutes: float, job_requests: int) -> list[str]:
    """The load phase's sweep: more rate jobs than `minutes` can hold (each arm of a job takes at
    least job_requests / RATE seconds); it is stopped when the time is up."""
    jobs = 4 * max(1, math.ceil(minutes * 60 / (2 * job_requests / RATE)))
    return ["backend=llamacpp_server", "method=ngram", "workload=chat", "load=rate", f"load.level={RATE}",
            f"load.num_requests={job_requests}", "max_new_tokens=32", "repeats=1", "warmup=false",
            f"seed=range(0,{jobs})", "slo.ttft_ms=3600000", "slo.tpot_ms=3600000", "report=false"]


def jobs_phase(jobs: int) -> list[str]:
    return ["method=ngram", "workload=chat", "batch_size=1", "num_prompts=1", "max_new_tokens=8", "repeats=1",
            "warmup=false", f"seed=range(0,{jobs})", "report=false"]


def sample_process(cmd: list[str], phase: str, log: Path, samples_csv: Path, stop_after_s: float | None = None) -> list[dict]:
    """Run one sweep, sampling it (and, apart, its children) until it exits, or until stop_after_s
    when it is sent SIGTERM (its exit 143 is then the expected end). Each sample is appended to
    samples_csv as it is taken."""
    import csv

    import psutil

    rows, t0, stopped = [], time.time(), False
    with open(log, "wb") as out, open(samples_csv, "a", newline="") as sink:
        writer = csv.DictWriter(sink, fieldnames=FIELDS)
        if sink.tell() == 0:
            writer.writeheader()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        proc = psutil.Process(p.pid)
        while p.poll() is None:
            if stop_after_s is not None and not stopped and time.time() - t0 >= stop_after_s:
                p.send_signal(signal.SIGTERM)  # the time is up: stopped as a scheduler stops a job
                stopped = True
            try:
                with proc.oneshot():
                    row = {"phase": phase, "t_s": round(time.time() - t0, 1), "rss_mib": proc.memory_info().rss / 2 ** 20,
                           "fds": proc.num_fds(), "threads": proc.num_threads()}
                kids = proc.children(recursive=True)
                row["children"] = len(kids)
                row["children_rss_mib"] = sum(k.memory_info().rss for k in kids if k.is_running()) / 2 ** 20
                rows.append(row)
                writer.writerow(row)
                sink.flush()
            except psutil.Error:  # the process ended between the poll and the sample
                pass
            time.sleep(SAMPLE_S)
    if p.returncode != 0 and not (stopped and p.returncode == 143):
        raise SystemExit(f"phase {phase}: the sweep exited with {p.returncode}; its output is in {log}")
    return rows


def summarize(samples, phase: str, jobs: int) -> dict:
    """One phase's row: medians of its first and last minute once settled (after a quarter of the
    phase, and at least its first minute: the model, the engine and the first job's imports
    load then), the peak, and the growth between them."""
    import numpy as np

    s = samples[samples.phase == phase]
    settle = max(60.0, 0.25 * s.t_s.max()) if (s.t_s >= 120).any() else 0.0
    settled = s[s.t_s >= settle]
    first, last = settled[settled.t_s <= settled.t_s.min() + 60], settled[settled.t_s >= settled.t_s.max() - 60]
    row = {"phase": phase, "duration_min": round(s.t_s.max() / 60, 1), "jobs": jobs, "samples": len(s),
           "settled_after_min": round(settle / 60, 1)}
    for col in ("rss_mib", "fds", "threads", "children_rss_mib"):
        a, b = float(np.median(first[col])), float(np.median(last[col]))
        row.update({f"{col}_first_min": round(a, 1), f"{col}_last_min": round(b, 1), f"{col}_peak": round(float(s[col].max()), 1)})
    row["rss_growth_mib"] = round(row["rss_mib_last_min"] - row["rss_mib_first_min"], 1)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="the measurement folder to write")
    ap.add_argument("--minutes", type=float, default=60.0, help="the load phase's length (default 60)")
    ap.add_argument("--job-requests", type=int, default=60, help="requests per arm of each load job (default 60)")
    ap.add_argument("--jobs", type=int, default=50, help="small jobs in the jobs phase (default 50)")
    ap.add_argument("--render", type=Path, help="only write index.md of an existing folder")
    a = ap.parse_args(argv)
    from bench.published import render, write_folder

    if a.render:  # index.csv again from samples.csv (the summary's rules may change), then the page
        import pandas as pd

        samples = pd.read_csv(a.render / "samples.csv")
        old = pd.read_csv(a.render / "index.csv")
        jobs = dict(zip(old.phase, old.jobs))
        pd.DataFrame([summarize(samples, ph, int(jobs[ph])) for ph in old.phase]).to_csv(a.render / "index.csv", index=False)
        print(render(a.render))
        return 0
    if not a.out:
        ap.error("give --out DIR (or --render DIR)")
    if a.minutes <= 0 or a.jobs < 1 or a.job_requests < 1:
        ap.error("--minutes, --jobs and --job-requests must be positive")
    import pandas as pd

    results = Path(tempfile.mkdtemp(prefix="specsweep-soak-"))
    base = [sys.executable, "-m", "bench.cli", "-m", f"results_dir={results}"]
    phases = [("load", load_phase(a.minutes, a.job_requests)), ("jobs", jobs_phase(a.jobs))]
    samples, commands = [], []
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "samples.csv").unlink(missing_ok=True)
    for name, overrides in phases:
        cmd = base + [f"sweep_name={name}"] + overrides
        commands.append("specsweep -m " + shlex.join(cmd[5:]))  # quoted: range(0,N) is not a bare shell word
        print(f"phase {name}: {' '.join(cmd[3:])}", flush=True)
        samples += sample_process(cmd, name, results / f"{name}.log", a.out / "samples.csv",
                                  a.minutes * 60 if name == "load" else None)
    df = pd.DataFrame(samples)
    n_jobs = {name: len(list((results / name).glob("*/summary.json"))) for name, _ in phases}
    rows = pd.DataFrame([summarize(df, name, n_jobs[name]) for name, _ in phases])
    write_folder(a.out, rows, "Soak: the sweep process's memory, files and threads over a long run",
                 [f"python benchmarks/soak.py --out {a.out} --minutes {a.minutes:g} --jobs {a.jobs}", *commands],
                 note=f"Samples every {SAMPLE_S:g} s ([samples.csv](samples.csv)); first/last minute: medians of "
                      "the first minute once settled (settled_after_min: a quarter of the phase, at least a minute: "
                      "the first completed job loads the result writers) and of the last; jobs: jobs completed (the "
                      "load phase's last one is cut by the stop); children: the engine servers the sweep started.")
    print(render(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
