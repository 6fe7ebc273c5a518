"""benchmarks/gpu_oracle.py: the oracle under the published cost model and a GPU run's fitted
target side by side (the drafting costs kept as published). Checked on a small random trace
file: the fitted model's file carries the fitted target and the published drafters; the
published target given as the "fitted" one reads 1.0 everywhere (the null control); a target
whose forward is mostly fixed cost (each extra verified token nearly free) raises the bounds.""" 
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from bench.costmodel import LLAMA31_8B_H100

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_oracle.py"


def _traces(tmp_path):
    rng = np.random.default_rng(3)
    rows = [{"id": str(i), "prompt_token_ids": list(range(30)), "generated_token_ids": list(range(40)),
             "acc_ngram": {"acc_len": [min(int(v), 40 - j) for j, v in enumerate(rng.integers(1, 5, 40))]},
             "acc_eagle": {"acc_len": [min(int(v), 40 - j) for j, v in enumerate(rng.integers(1, 4, 40))]}}
            for i in range(16)]
    f = tmp_path / "combined_toy.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f


def _run(tmp_path, target, *extra, overhead=LLAMA31_8B_H100.overhead_per_step):
    fitted = tmp_path / "cost_8b.yaml"
    fitted.write_text(yaml.safe_dump({"name": "fitted", "target": target, "overhead_per_step": overhead,
                                      "drafters": {"synthetic": {"kind": "relative", "fraction": 0.01}}}))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(SCRIPT), str(fitted), str(_traces(tmp_path)), "--out", str(out), *extra],
                       capture_output=True, text=True, timeout=300)
    return r, out


P = {"c_kv": LLAMA31_8B_H100.c_kv, "c_compute": LLAMA31_8B_H100.c_compute, "c_fixed": LLAMA31_8B_H100.c_fixed}
RATIOS = ["best_fixed_speedup_ratio", "dp_speedup_ratio", "best_realizable_speedup_ratio"]


def test_the_published_target_as_the_fitted_one_reads_1(tmp_path):
    r, out = _run(tmp_path, P, "--batch-sizes", "1", "8", "--accounting", "faithful")
    assert r.returncode == 0, r.stderr[-2000:]
    used = yaml.safe_load((out / "cost_fitted.yaml").read_text())
    assert used["target"] == pytest.approx(P)
    assert used["drafters"]["eagle"]["c_fixed"] == LLAMA31_8B_H100.default_neural.c_fixed
    assert used["drafters"]["ngram"]["fraction"] == LLAMA31_8B_H100.default_ngram.fraction
    gap = pd.read_csv(out / "gap.csv")
    assert sorted(gap.batch_size) == [1, 8] and set(gap.accounting) == {"faithful"}
    assert np.allclose(gap[RATIOS].to_numpy(), 1.0, atol=1e-9)
    assert (gap.dp_speedup_fitted >= gap.best_realizable_speedup_fitted - 1e-9).all()
    assert "| toy | 1 | faithful |" in (out / "gap.md").read_text()


def test_a_target_of_mostly_fixed_cost_raises_the_bounds(tmp_path):
    r, out = _run(tmp_path, {**P, "c_fixed": 20 * P["c_fixed"]}, "--batch-sizes", "1", "--accounting", "faithful")
    assert r.returncode == 0, r.stderr[-2000:]
    gap = pd.read_csv(out / "gap.csv")
    assert (gap.dp_speedup_ratio > 1.001).all() and (gap.best_fixed_speedup_ratio > 1.001).all(), gap.to_string()


def test_a_missing_cost_file_or_trace_is_refused_naming_it(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "none.yaml"), str(_traces(tmp_path)), "--out",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "none.yaml: no such file" in r.stderr
    r, _ = _run(tmp_path, {"c_kv": 1e-8, "c_compute": 1e-5, "c_fixed": 5e-3})
    bad = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "cost_8b.yaml"), str(tmp_path / "x.jsonl"), "--out",
                          str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "x.jsonl" in bad.stderr
