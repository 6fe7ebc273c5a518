"""Adapter overhead: baseline decode tokens/s of both llama.cpp modes against llama-bench's tg
figure for the same GGUF, threads and machine, interleaved in one run.

  python benchmarks/llamacpp_overhead.py [--tokens 128] [--rounds 3] [--threads 2]

In process: decode-only rate of specsweep's own loop (one llama_decode per token, batch 1,
prefill excluded). llama-server: its own timings.predicted_per_second for one request. llama-bench:
`-p 0 -n N` (text generation only)."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.llamacpp import LlamaCppBackend, resolve_gguf  # noqa: E402
from backends.llamacpp_server import LlamaServerBackend, find_binary  # noqa: E402
from bench.backend import Sampling  # noqa: E402
from bench.environment import load_average  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"], help="in-process context only")
    a = ap.parse_args()
    gguf = resolve_gguf("gemma3-270m")
    bench_bin = str(Path(find_binary(None)).parent / "llama-bench")
    inproc = LlamaCppBackend({"path": "gemma3-270m"}, {"name": "autoregressive"}, threads=a.threads, flash_attn=a.flash_attn)
    server = LlamaServerBackend({"path": "gemma3-270m"}, {"name": "autoregressive"}, threads=a.threads)
    prompt = inproc.tokenize("The history of the Roman Empire is")
    rates = {"llama-bench tg": [], "in process": [], "llama-server": []}
    print("load average", load_average(), flush=True)
    try:
        inproc.generate([prompt], Sampling(), 8, speculative=False)  # warm-up
        for r in range(a.rounds):
            out = subprocess.run([bench_bin, "-m", gguf, "-p", "0", "-n", str(a.tokens), "-t", str(a.threads), "-r", "1",
                                  "-o", "json"], capture_output=True, text=True, check=True)
            rates["llama-bench tg"].append(json.loads(out.stdout)[0]["avg_ts"])
            o = inproc.generate([prompt], Sampling(), a.tokens, speculative=False)
            decode_s = sum(c["t_draft"] + c["t_verify"] + c["t_other"] for c in o.cycles)
            rates["in process"].append(sum(c["emitted"] for c in o.cycles) / decode_s)
            import httpx

            s = server._server(False, 1)
            d = httpx.post(s.url + "/completion", json={"prompt": prompt, "n_predict": a.tokens, "temperature": 0,
                                                        "cache_prompt": False, "ignore_eos": True}, timeout=600).json()
            rates["llama-server"].append(d["timings"]["predicted_per_second"])
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()), flush=True)
    finally:
        inproc.close()
        server.close()
    ref = statistics.median(rates["llama-bench tg"])
    for k, v in rates.items():
        m = statistics.median(v)
        print(f"{k:16s} median {m:6.1f} tok/s  ({100 * (m / ref - 1):+.1f}% vs llama-bench)")
    print("load average", load_average())


if __name__ == "__main__":
    main()
