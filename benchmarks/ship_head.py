"""Make the head the package ships: a bfloat16 copy of a head specsweep-train-eagle wrote for the
default model, in the same published EAGLE-3 layout, with its training record, and the acceptance
check the trainer ran repeated on the copy (same held-out prompts, k, token count), so the
record says what the copy itself reaches. Not a test: a maintainer's step after training.

  python benchmarks/ship_head.py [--method eagle3|p_eagle] [--src FOLDER]

--src defaults to where the trainer writes for the default model; the copy goes to
backends/native/shipped_heads/<model>/<method>/, where the engine finds it when no head was
trained on the machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MAX_MB = 50  # what a repository file should stay under


def main(argv=None) -> int:
    import torch

    from backends.native.heads import SHIPPED_HEADS, default_head_dir, load_head, save_eagle3_head
    from backends.native.loading import DEFAULT_MODEL, load_model
    from backends.native.train_eagle import DEFAULT_WORKLOADS, eval_prompts, held_out_acceptance

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=("eagle3", "p_eagle"), default="eagle3")
    ap.add_argument("--src", type=Path, help="the trained head's folder (default: where the trainer writes)")
    a = ap.parse_args(argv)
    src = a.src or default_head_dir(DEFAULT_MODEL, a.method)
    record_file = src / "specsweep_train.json"
    if not record_file.exists():
        print(f"ship_head: {src} has no specsweep_train.json; ship only a head specsweep-train-eagle wrote", file=sys.stderr)
        return 2
    record = json.loads(record_file.read_text())
    dst = SHIPPED_HEADS / DEFAULT_MODEL / a.method
    model, tokenizer, args, _ = load_model(DEFAULT_MODEL)
    parallel = a.method == "p_eagle"
    head = load_head(src, model, args, "eagle3", parallel=parallel)
    with torch.inference_mode():
        save_eagle3_head(head, dst, dtype=torch.bfloat16)
        copy = load_head(dst, model, args, "eagle3", parallel=parallel)
        evals = eval_prompts(DEFAULT_WORKLOADS, 2)  # the trainer's default held-out prompts
        k = record["held_out"]["k"]
        record["shipped"] = {"dtype": "bfloat16", "from": "float32 head written by the command above",
                             "held_out": held_out_acceptance(model, tokenizer, tuple(args.eos_token_ids), copy, k, evals, 48)}
    for path_on_the_training_machine in ("data_dir", "target"):
        record.pop(path_on_the_training_machine, None)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["specsweep"] = {key: v for key, v in record.items() if key != "held_out_estimates"}
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    (dst / "specsweep_train.json").write_text(json.dumps(record, indent=1))
    mb = sum(f.stat().st_size for f in dst.iterdir()) / 1e6
    print(json.dumps({"to": str(dst), "megabytes": round(mb, 1), "trained": record["held_out"],
                      "shipped": record["shipped"]["held_out"]}, indent=1))
    if mb > MAX_MB:
        print(f"ship_head: {dst} holds {mb:.1f} MB, over the {MAX_MB} MB a repository file should stay under", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
