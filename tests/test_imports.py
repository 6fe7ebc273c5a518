"""specsweep-import: result files of vllm bench serve, AIPerf and GuideLLM written by the real tools
on this machine (tests/data/formats/README.md says how), and Spec-Bench answers built here in the
format its own writer uses (evaluation/eval.py: it needs a GPU model to run), read into specsweep
rows that the report and the gate then use."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from bench import imports

DATA = Path(__file__).resolve().parent / "data" / "formats"


def _import(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.imports", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def _rows(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*/summary.json"))]


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def test_each_format_is_recognized_from_its_keys(tmp_path):
    assert imports.detect(DATA / "vllm_bench_c2.json") == "vllm-bench"
    assert imports.detect(DATA / "aiperf_llama_c2" / "profile_export_aiperf.json") == "aiperf"
    assert imports.detect(DATA / "guidellm_llama_c2.json") == "guidellm"
    other = tmp_path / "x.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(imports.UnreadableResultFile, match=r"not a result file of a known tool; known: vllm bench serve JSON"):
        imports.detect(other)


def test_vllm_bench_files_become_paired_rows_in_seconds_and_vllms_acceptance(tmp_path):
    r = _import(DATA / "vllm_bench_c2.json", "--baseline", DATA / "vllm_bench_c2_baseline.json", "--out", tmp_path / "a",
                "--temperature", "0", "--engine", "llamacpp_server", "--method", "ngram")
    assert r.returncode == 0, r.stderr
    (row,) = _rows(tmp_path / "a")
    src, base = (json.loads((DATA / f).read_text()) for f in ("vllm_bench_c2.json", "vllm_bench_c2_baseline.json"))
    assert (row["backend"], row["method"], row["load_label"], row["batch_size"]) == ("llamacpp_server", "ngram", "c2", 2)
    assert row["ttft_p50"] == pytest.approx(src["median_ttft_ms"] / 1000) and row["tpot_p99"] == pytest.approx(src["p99_tpot_ms"] / 1000)
    assert row["speedup"] == pytest.approx(src["output_throughput"] / base["output_throughput"])
    assert row["tpot_speedup"] == pytest.approx(base["median_tpot_ms"] / src["median_tpot_ms"])
    assert row["baseline_tpot_p50"] == pytest.approx(base["median_tpot_ms"] / 1000)
    assert _missing(row.get("speedup_ci_low"))  # one run per arm: no interval, none invented
    assert "vllm-bench" in row["imported_from"] and "from --temperature" in row["imported_from"]
    # llama-server's draft counts are in no file vllm bench writes: no acceptance, not a zero
    assert row["speculative"] is True and _missing(row.get("acceptance_rate"))
    # the vLLM server's /metrics deltas: vLLM's own acceptance, under specsweep's definitions
    r = _import(DATA / "vllm_bench_vllm_ngram_c2.json", "--out", tmp_path / "v", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    (v,) = _rows(tmp_path / "v")
    d = json.loads((DATA / "vllm_bench_vllm_ngram_c2.json").read_text())
    assert v["acceptance_rate"] == pytest.approx(d["spec_decode_acceptance_rate"] / 100)
    assert v["mean_acceptance_length"] == pytest.approx(d["spec_decode_acceptance_length"])
    assert v["per_position_acceptance"] == pytest.approx(d["spec_decode_per_position_acceptance_rates"], abs=0.01)
    assert v["num_speculative_tokens"] == 3 and v["method"] == "imported"


def test_aiperf_and_guidellm_files_read_latency_and_per_request_acceptance(tmp_path):
    r = _import(DATA / "aiperf_llama_ngram_c2" / "profile_export_aiperf.json", "--baseline",
                DATA / "aiperf_llama_c2" / "profile_export_aiperf.json", "--out", tmp_path / "ai", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    (ai,) = _rows(tmp_path / "ai")
    d = json.loads((DATA / "aiperf_llama_ngram_c2" / "profile_export_aiperf.json").read_text())
    assert ai["ttft_p90"] == pytest.approx(d["time_to_first_token"]["p90"] / 1000)
    assert ai["tpot_p50"] == pytest.approx(d["inter_token_latency"]["p50"] / 1000)  # AIPerf's ITL: vLLM's TPOT
    assert ai["load_label"] == "c2" and ai["workload"] == "synthetic" and ai["speedup"] > 0
    # the vLLM server's per-request blocks: counts summed over requests, acceptance per request
    for f in (DATA / "aiperf_vllm_ngram_c2" / "profile_export_aiperf.json", DATA / "guidellm_vllm_ngram_c2.json"):
        out = tmp_path / f.parent.name / f.stem
        r = _import(f, "--out", out, "--temperature", "0")
        assert r.returncode == 0, r.stderr
        (row,) = _rows(out)
        counts = row["acceptance_counts"]
        assert row["num_speculative_tokens"] == 3 and counts["drafts"] > 0 and counts["draft_tokens"] > 0
        assert row["acceptance_rate"] == pytest.approx(counts["accepted_tokens"] / counts["draft_tokens"])
        assert row["request_acceptance_p50"] == row["request_acceptance_p50"]  # per-request figures are there
    g = json.loads((DATA / "guidellm_llama_ngram_c2.json").read_text())
    r = _import(DATA / "guidellm_llama_ngram_c2.json", "--baseline", DATA / "guidellm_llama_c2.json", "--out",
                tmp_path / "gl", "--temperature", "0", "--model", "gemma3-270m")
    assert r.returncode == 0, r.stderr
    (gl,) = _rows(tmp_path / "gl")
    itl = g["benchmarks"][0]["metrics"]["inter_token_latency_ms"]["successful"]["percentiles"]["p50"]
    assert gl["tpot_p50"] == pytest.approx(itl / 1000)  # GuideLLM's ITL, not its first-token-including TPOT
    assert gl["model"] == "gemma3-270m" and gl["workload"] == "synthetic_text"
    # the report runs on imported rows, and says where they came from
    rep = subprocess.run([sys.executable, "-m", "bench.report", str(tmp_path / "gl")], capture_output=True, text=True,
                         timeout=300)
    assert rep.returncode == 0, rep.stderr[-2000:]
    text = (tmp_path / "gl" / "report" / "summary.md").read_text()
    assert "read from other tools' result files by specsweep-import" in text and "synthetic_text" in text


def _spec_bench_answers(path: Path, seconds: float, accept: list[int]) -> None:
    """Spec-Bench's answer lines, keyed as its evaluation/eval.py writes them."""
    lines = [{"question_id": 81 + i, "category": cat, "answer_id": f"a{i}", "model_id": "vicuna-7b-v1.3-eagle",
              "choices": [{"index": 0, "turns": ["text"], "decoding_steps": [len(accept)], "new_tokens": [sum(accept)],
                           "wall_time": [seconds], "accept_lengths": accept}], "tstamp": 1.0}
             for i, cat in enumerate(("writing", "math"))]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_spec_bench_answers_in_its_documented_format_and_the_gate_on_imported_rows(tmp_path):
    _spec_bench_answers(tmp_path / "eagle.jsonl", 1.0, [4, 1, 3, 2])
    _spec_bench_answers(tmp_path / "base.jsonl", 2.0, [1] * 10)
    r = _import(tmp_path / "eagle.jsonl", "--baseline", tmp_path / "base.jsonl", "--out", tmp_path / "sb",
                "--temperature", "0", "--method", "eagle", "--k", "3")
    assert r.returncode == 0, r.stderr
    (row,) = _rows(tmp_path / "sb")
    assert row["mean_acceptance_length"] == pytest.approx(10 / 4) and row["num_speculative_tokens"] == 3
    assert row["tokens_per_s"] == pytest.approx(20 / 2.0) and row["speedup"] == pytest.approx((20 / 2.0) / (20 / 4.0))
    assert row["per_position_acceptance"] == pytest.approx([0.75, 0.5, 0.25])
    # the gate records the imported rows and passes them against themselves
    baseline = tmp_path / "gate.json"
    g = subprocess.run([sys.executable, "-m", "bench.gate", str(tmp_path / "sb"), "--baseline", str(baseline), "--update"],
                       capture_output=True, text=True, timeout=120)
    assert g.returncode == 0, g.stderr
    g = subprocess.run([sys.executable, "-m", "bench.gate", str(tmp_path / "sb"), "--baseline", str(baseline)],
                       capture_output=True, text=True, timeout=120)
    assert g.returncode == 0, g.stdout + g.stderr
    # a worse drafter's answers, imported the same way, fail it
    _spec_bench_answers(tmp_path / "eagle.jsonl", 1.0, [2, 1, 1, 2])
    r = _import(tmp_path / "eagle.jsonl", "--baseline", tmp_path / "base.jsonl", "--out", tmp_path / "sb",
                "--temperature", "0", "--method", "eagle", "--k", "3")
    assert r.returncode == 0, r.stderr
    g = subprocess.run([sys.executable, "-m", "bench.gate", str(tmp_path / "sb"), "--baseline", str(baseline)],
                       capture_output=True, text=True, timeout=120)
    assert g.returncode == 1 and "mean_acceptance_length" in g.stdout, g.stdout + g.stderr
    idx = pd.read_csv(tmp_path / "sb" / "index.csv")
    assert len(idx) == 1  # the same run imported again replaces its job, it is not a second one


def test_bad_input_names_the_file_and_what_is_valid(tmp_path):
    r = _import(DATA / "vllm_bench_c2.json", "--out", tmp_path / "x")
    assert r.returncode == 2 and "does not record the sampling temperature; pass --temperature" in r.stderr
    r = _import(tmp_path / "missing.json", "--out", tmp_path / "x", "--temperature", "0")
    assert r.returncode == 2 and "missing.json: no such file" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "choices": [{"turns": ["x"]}]}) + "\n")
    r = _import(bad, "--out", tmp_path / "x", "--temperature", "0")
    assert r.returncode == 2 and "choices[0].new_tokens and .wall_time" in r.stderr
    r = _import(DATA / "vllm_bench_c2.json", "--out", tmp_path / "x", "--temperature", "-1")
    assert r.returncode == 2 and "--temperature=-1.0: use 0" in r.stderr
    assert not (tmp_path / "x").exists()


def test_the_load_cross_check_reads_vllm_bench_records_as_vllm_summarizes_them():
    """benchmarks/load_crosscheck.py computes both clients' percentiles with one function from
    their per-request records; on a file `vllm bench serve --save-detailed` wrote here, that
    function gives back vLLM's own summary (TPOT by its formula, ITL over every gap) to the digit,
    so a difference between the clients is theirs, not the cross-check's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("load_crosscheck", DATA.parents[2] / "benchmarks" / "load_crosscheck.py")
    crosscheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(crosscheck)
    d = json.loads((DATA / "vllm_bench_c2.json").read_text())
    got = crosscheck.percentiles(crosscheck.vllm_bench_requests(d))
    for metric in crosscheck.METRICS:
        for p in crosscheck.PERCENTILES:
            assert got[f"{metric}_p{p}"] == pytest.approx(d[f"p{p}_{metric}_ms"], rel=1e-9), (metric, p)
