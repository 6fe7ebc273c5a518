"""benchmarks/native_speed.py --record: a run kept as a measurement folder the docs fill figures
from (bench/published.py), checked on a hand-built result (the benchmark itself measures this
machine and is not a test)."""
import argparse
import importlib.util
import json
from pathlib import Path

import pandas as pd

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "native_speed.py"


def _module():
    spec = importlib.util.spec_from_file_location("native_speed", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_a_run_becomes_one_row_with_its_eager_and_compiled_figures(tmp_path, monkeypatch):
    import bench.published

    monkeypatch.setattr(bench.published, "MEASUREMENTS", tmp_path)  # where the docs' folders live
    res = {"cpu": "Test CPU", "threads": 2, "loadavg_start": [0.5, 0.4, 0.3], "loadavg_end": [0.9, 0.5, 0.3],
           "torch": "2.x", "kernels": {"wqkv": "rowdot"}, "decode_ms": 80.0, "roofline_share": 0.71,
           "verify_cost_ratio": {1: 1.0, 5: 1.4}, "tokens_per_s": {"native_baseline": 12.0, "native_ngram": 30.0},
           "native_ngram_speedup": 2.5, "goals": {"roofline_share >= 0.7": True, "r(5) <= 1.5": True},
           "compiled": {"mode": "default", "decode_ms": 85.0, "verify_cost_ratio": {1: 1.0, 5: 2.1},
                        "ngram_speedup": 1.6}}
    out = tmp_path / "2026-01-01-native-speed"
    args = argparse.Namespace(out=str(tmp_path / "native_speed.json"), record=out, compile="default", threads=2)
    _module().save(res, args, "python benchmarks/native_speed.py --compile default")  # as main ends
    assert json.loads((tmp_path / "native_speed.json").read_text())["settings"]["record"] == str(out)
    row = pd.read_csv(out / "index.csv").iloc[0]
    assert row.decode_ms == 80.0 and row.r5 == 1.4 and row.tokens_per_s_native_ngram == 30.0
    assert row.compiled_mode == "default" and row.compiled_r5 == 2.1 and row.compiled_ngram_speedup == 1.6
    assert bool(row.goal_roofline) and bool(row.goal_r5)
    env = json.loads((out / "environment.json").read_text())
    assert env["commands"] == ["python benchmarks/native_speed.py --compile default"] and env["loadavg_range"] == [0.5, 0.9]
    assert "rowdot" in env["note"] and (out / "index.md").is_file()
