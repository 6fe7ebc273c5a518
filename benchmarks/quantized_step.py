"""What a quantized self-draft's step costs against its target's: one decode step (one token, a
cache of about 100 positions) of the default model on the native engine at float32, and of its
int8 and int4 copies (method=quantized_draft), each with the full vocabulary and with the first
--vocab token ids only (method.draft_vocab). Interleaved rounds, medians; the ratio to the
target's step is the draft's cost c before any loop overhead. Not a test: it measures this
machine (prints its CPU, threads and load).

  python benchmarks/quantized_step.py [--rounds 15] [--vocab 16384] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=16384, help="the vocabulary limit of the limited variants")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    a = ap.parse_args(argv)
    if a.rounds < 3 or a.vocab < 1:
        ap.error("--rounds must be 3 or more and --vocab positive")
    import torch

    from backends.native import kernels
    from backends.native.loading import load_model
    from backends.native.quantized import quantized_bytes, quantized_copy
    from bench.environment import snapshot

    model, tok, _, _ = load_model("gemma3-270m")
    kernels.tune(model.matrices(), log=lambda *_: None)  # the target's products as the engine runs them
    ids = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
                     "fibonacci(n - 2)\n" * 3).ids
    variants = {"target float32": (model, None), f"target float32, first {a.vocab} ids": (model, a.vocab)}
    for bits in (8, 4):
        q = quantized_copy(model, bits)
        variants[f"int{bits}"] = (q, None)
        variants[f"int{bits}, first {a.vocab} ids"] = (q, a.vocab)
    prompt = torch.tensor([ids])
    one, at = torch.tensor([[ids[-1]]]), torch.tensor([[len(ids)]])
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for m, _ in variants.values():
            m.setup_cache(1, 512)
            m(prompt, torch.arange(len(ids))[None], rows=torch.tensor([0]))
        for _ in range(a.rounds):  # interleaved: every variant once per round
            for name, (m, vocab) in variants.items():
                t0 = time.perf_counter()
                m(one, at, rows=torch.tensor([0]), vocab_limit=vocab)
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["target float32"])
    out = {"cpu": snapshot()["cpu"], "threads": torch.get_num_threads(), "loadavg": os.getloadavg()[0],
           "rounds": a.rounds, "torch": torch.__version__, "steps_ms": {}}
    print(f"{out['cpu']}, {out['threads']} threads, load average {out['loadavg']:.2f}, {a.rounds} rounds")
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        out["steps_ms"][name] = ms
        print(f"  {name:32s} {ms:7.2f} ms  c = {ms / 1e3 / base:.2f}")
    for bits in (8, 4):
        q = variants[f"int{bits}"][0]
        print(f"  int{bits} weights a step: {quantized_bytes(q) / 2 ** 20:.0f} MiB "
              f"(float32 target: {sum(w.numel() * 4 for w in model.matrices()) / 2 ** 20:.0f} MiB)")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
