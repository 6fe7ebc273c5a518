"""llama.cpp in process (llama-cpp-python) on the real Gemma 3 270M GGUF, through the harness's
own draft/verify loop, and the library's own prompt lookup as a user calls it."""
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from backends.llamacpp import LlamaCppBackend
from bench import metrics
from bench.backend import BackendError, Sampling
from lossless_probe import clearest_decision, weighed_lossless  # tests/lossless_probe.py
from workloads import load_prompts


@pytest.fixture(scope="module")
def code_edit_prompts():
    return [p.text for p in load_prompts("code_edit", 3, seed=0)]


def _run(method, prompts, k=4, batch=False, n=32, weigh=False):
    """Both arms on the same prompts; with weigh, also the harness's lossless verdict on them (its
    divergences weighed by the engine, after the runs, as a job does)."""
    b = LlamaCppBackend({"path": "gemma3-270m"}, method, num_speculative_tokens=k)
    try:
        ids = [b.tokenize(t) for t in prompts]
        groups = [ids] if batch else [[x] for x in ids]
        base = [b.generate(g, Sampling(), n, speculative=False) for g in groups]
        spec = [b.generate(g, Sampling(), n, speculative=True) for g in groups]
        verdict = weighed_lossless(b, [i for g in groups for i in g], base, spec, k) if weigh else None
    finally:
        b.close()
    return (base, spec, verdict) if weigh else (base, spec)


def _cycles(outs):
    return [c for o in outs for c in o.cycles]


@pytest.mark.slow
def test_ngram_on_code_edit_drafts_accepts_and_is_lossless(code_edit_prompts):
    base, spec = _run({"name": "ngram"}, code_edit_prompts)
    assert [r.output_token_ids for o in spec for r in o.requests] == [r.output_token_ids for o in base for r in o.requests]
    cyc = _cycles(spec)
    drafted = np.array([c["drafted"] for c in cyc])
    accepted = np.array([c["accepted"] for c in cyc])
    assert drafted.sum() > 0 and accepted.sum() > 0
    assert (accepted <= drafted).all()
    pos = metrics.per_position_acceptance(drafted, accepted, 4)
    assert all(a >= b - 1e-12 for a, b in zip(pos, pos[1:]))  # per-position rates never increase
    # tau = 1 + accepted / drafts, over cycles that drafted
    assert metrics.mean_acceptance_length(drafted, accepted) == pytest.approx(1 + accepted.sum() / (drafted > 0).sum())
    assert all(c["t_verify"] > 0 for c in cyc)


@pytest.mark.slow
def test_self_draft_accepts_everything_and_batches_stay_lossless(code_edit_prompts):
    base, spec, verdict = _run({"name": "draft_model", "draft_path": "gemma3-270m"}, code_edit_prompts[:2], k=3, batch=True,
                               n=24, weigh=True)
    cyc = _cycles(spec)
    alpha = metrics.acceptance_rate([c["drafted"] for c in cyc], [c["accepted"] for c in cyc])
    assert alpha > 0.95  # draft = target; batched logits can flip a near-tie, hence not exactly 1
    assert verdict["lossless"] == "true", verdict  # any divergence is a near-tie or within the engine's shapes


@pytest.mark.slow
def test_a_draft_derived_from_the_target_keeps_its_first_layers_and_drafts_losslessly(code_edit_prompts):
    """draft_model with no draft_path: the target's first draft_layers layers and its head, as a GGUF
    written once (backends/gguf_draft.py) and reused; an untrained early exit accepts some drafts."""
    import gguf

    from backends.gguf_draft import derived_draft_path
    from backends.llamacpp import resolve_gguf

    method = {"name": "draft_model", "draft_path": None, "draft_layers": 9}
    base, spec, verdict = _run(method, code_edit_prompts[:2], k=3, n=24, weigh=True)
    target = Path(resolve_gguf("gemma3-270m"))
    draft = derived_draft_path(target, 9)
    written = draft.stat().st_mtime_ns
    reader = gguf.GGUFReader(str(draft))
    assert int(reader.get_field("gemma3.block_count").contents()) == 9
    layers = {int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk.")}
    assert layers == set(range(9))
    whole = {t.name: t for t in gguf.GGUFReader(str(target)).tensors}
    for t in reader.tensors:  # copied byte for byte, nothing re-quantized
        assert t.tensor_type == whole[t.name].tensor_type and np.array_equal(t.data, whole[t.name].data), t.name
    cyc = _cycles(spec)
    alpha = metrics.acceptance_rate([c["drafted"] for c in cyc], [c["accepted"] for c in cyc])
    assert 0 < alpha < 0.95, alpha  # half the layers: some drafts right, not all
    assert verdict["lossless"] == "true", verdict
    b = LlamaCppBackend({"path": "gemma3-270m"}, method, num_speculative_tokens=3)  # the second job reuses the file
    assert b.draft_path == str(draft) and draft.stat().st_mtime_ns == written
    assert "first 9 layers" in b.describe()["drafter"]
    b.close()


@pytest.mark.slow
def test_library_prompt_lookup_counted_by_wrapping_its_drafter(code_edit_prompts):
    base, spec = _run({"name": "prompt_lookup_lib"}, code_edit_prompts[:2], k=4)
    assert [r.output_token_ids for o in spec for r in o.requests] == [r.output_token_ids for o in base for r in o.requests]
    cyc = _cycles(spec)
    assert sum(c["drafted"] for c in cyc) > 0 and all(c["accepted"] <= c["drafted"] for c in cyc)
    assert "wrapping" in spec[0].counters["note"]
    # the baseline is the library's own plain path (no drafter), not specsweep's loop
    assert base[0].cycles is None and base[0].counters == {}


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="needs a .gguf model file"):
        LlamaCppBackend({"path": str(tmp_path / "missing.gguf")}, {"name": "ngram"})
    with pytest.raises(ValueError, match="method 'layer_skip' is not supported by backend llamacpp"):
        LlamaCppBackend({"path": "gemma3-270m"}, {"name": "layer_skip"})
    for layers in (0, 18):  # Gemma 3 270M has 18 layers: a derived draft keeps 1 to 17 of them
        with pytest.raises(ValueError, match=f"method.draft_layers={layers} cannot derive a draft .* it has 18 "
                                             "layers; valid: 1 to 17"):
            LlamaCppBackend({"path": "gemma3-270m"}, {"name": "draft_model", "draft_path": None, "draft_layers": layers})
        with pytest.raises(ValueError, match=f"draft_layers={layers}"):  # the pre-check, before any model loads
            LlamaCppBackend.check_config({}, {"path": "gemma3-270m"}, {"name": "draft_model", "draft_layers": layers}, 4)
    with pytest.raises(ValueError, match="backend.threads=0 is not valid"):
        LlamaCppBackend({"path": "gemma3-270m"}, {"name": "ngram"}, threads=0)


def _worker_pids():
    """This process's llama.cpp engine workers (not probes), from /proc."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"backends.llamacpp_worker" in cmd and b"--probe" not in cmd:
            pids.append(int(p.name))
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("repack", ["off", "on"])
def test_forced_repack_setting_reaches_the_engine_and_the_row(repack, code_edit_prompts, tmp_path, monkeypatch):
    import backends.llamacpp as adapter

    works_here = True
    if repack == "on":  # the real probe, in a cache of its own: on a CPU where repacking dies, forcing it must
        monkeypatch.setenv("SPECSWEEP_CACHE", str(tmp_path / "probe"))  # fail clearly (it did on an AMX Xeon)
        works_here = adapter.repack_verdict("auto", adapter.resolve_gguf("gemma3-270m"), 2).usable
    monkeypatch.setenv("SPECSWEEP_CACHE", str(tmp_path / "job"))  # a forced setting must not probe: no verdict written
    b = LlamaCppBackend({"path": "gemma3-270m"}, {"name": "ngram"}, num_speculative_tokens=3, repack=repack)
    try:
        if works_here:
            out = b.generate([b.tokenize(code_edit_prompts[0])], Sampling(), 8, speculative=True)
            assert len(out.requests[0].output_token_ids) == 8
            assert b.use_extra_bufts is (repack == "on")  # what llama.cpp's loader was given, read back in the worker
            d = b.describe()
            assert d["repack"] == repack and f"backend.repack={repack}" in d["repack_reason"]
            buffers = d["weight_buffers_mib"]  # as llama.cpp's load logged them
            assert buffers and sum(buffers.values()) > 200  # the 235 MiB of Gemma's weights, in whatever layout
            if repack == "off":
                assert not any("REPACK" in name or "AMX" in name for name in buffers), buffers
        else:
            with pytest.raises(BackendError, match=r"(?s)killed by SIG.*backend\.repack=on forced llama\.cpp's weight "
                                                   r"repacking.*backend\.repack=auto tries it once on this CPU"):
                b.generate([b.tokenize(code_edit_prompts[0])], Sampling(), 8, speculative=True)
            assert b.describe()["repack"] == "on"  # the row says what was forced
    finally:
        b.close()
    assert not (tmp_path / "job" / "probes").exists()


@pytest.mark.slow
def test_auto_repack_probes_once_and_a_crashing_probe_turns_repacking_off(tmp_path, monkeypatch):
    import backends.llamacpp as adapter
    from backends.cpu_probe import run_child

    monkeypatch.setenv("SPECSWEEP_CACHE", str(tmp_path / "real"))
    first = adapter.repack_verdict("auto", adapter.resolve_gguf("gemma3-270m"), 2)  # the real probe, on this CPU
    assert ("probe passed" in first.reason) == first.usable and "cached" not in first.reason
    again = adapter.repack_verdict("auto", adapter.resolve_gguf("gemma3-270m"), 2)
    assert again.usable == first.usable and "cached probe" in again.reason

    # A CPU where the repacked path crashes, simulated by a probe child that dies by SIGSEGV.
    monkeypatch.setenv("SPECSWEEP_CACHE", str(tmp_path / "crashing"))
    segv = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    monkeypatch.setattr(adapter, "run_child", lambda cmd, timeout_s, env=None: run_child(segv, timeout_s))
    b = LlamaCppBackend({"path": "gemma3-270m"}, {"name": "ngram"}, num_speculative_tokens=3)
    try:
        assert b.tokenize("def f(x):")
        assert b.use_extra_bufts is False
        d = b.describe()
        assert d["repack"] == "off" and "SIGSEGV" in d["repack_reason"]
    finally:
        b.close()


@pytest.mark.slow
def test_an_engine_crash_is_a_backend_error_naming_the_signal(code_edit_prompts):
    from bench.backend import BackendError

    b = LlamaCppBackend({"path": "gemma3-270m"}, {"name": "ngram"}, num_speculative_tokens=3, repack="off")
    try:
        ids = b.tokenize(code_edit_prompts[0])
        b.worker.proc.send_signal(signal.SIGSEGV)
        b.worker.proc.wait(timeout=30)
        with pytest.raises(BackendError, match=r"llama.cpp worker was killed by SIGSEGV \(signal 11\)"):
            b.generate([ids], Sampling(), 8, speculative=True)
    finally:
        b.close()
    assert not _worker_pids()


@pytest.mark.slow
def test_a_crash_mid_sweep_is_an_error_row_and_the_test_run_survives(tmp_path):
    """The worker is killed by SIGSEGV while the job measures: the job's row says so, the sweep
    process (here, the test process) goes on."""
    from hydra import compose, initialize_config_dir

    from bench.cli import CONF_DIR
    from bench.runner import run_job

    killed = []

    def kill_when_measuring():
        deadline = time.time() + 120
        while time.time() < deadline and not killed:
            pids = _worker_pids()
            if pids:
                time.sleep(1.5)  # the model is loaded and the job is measuring
                for pid in _worker_pids():
                    os.kill(pid, signal.SIGSEGV)
                    killed.append(pid)
            time.sleep(0.05)

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={tmp_path}", "sweep_name=crash", "backend=llamacpp",
                                           "backend.repack=off", "method=ngram", "workload=code_edit", "num_prompts=2",
                                           "max_new_tokens=256", "repeats=3", "report=false"])
    t = threading.Thread(target=kill_when_measuring, daemon=True)
    t.start()
    row = run_job(cfg)
    t.join(timeout=5)
    assert killed, "the worker was never seen"
    assert row["status"] == "error" and "SIGSEGV" in row["error"], row.get("error")
    assert not _worker_pids()


@pytest.mark.slow
def test_a_sweep_killed_by_sigkill_leaves_no_engine_process(tmp_path):
    """The sweep process SIGKILLed while its job measures (nothing of it runs to clean up): the
    engine worker leads a process group of its own, and the worker and everything in its group
    are gone within seconds (the kernel's parent-death signal; backends/worker_loop.py)."""
    import subprocess

    from procs import cmdline, descendants, in_group, pgid, left_after  # tests/procs.py

    p = subprocess.Popen([sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", "sweep_name=k",
                          "backend=llamacpp", "backend.repack=off", "method=ngram", "workload=code_edit",
                          "batch_size=1", "num_prompts=2", "max_new_tokens=256", "repeats=3", "report=false"],
                         stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err.txt", "w"),
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline, workers = time.time() + 300, []
        while time.time() < deadline and p.poll() is None and not (workers and list(tmp_path.glob("k/*/llamacpp-worker.log"))):
            workers = [c for c in descendants(p.pid) if "backends.llamacpp_worker" in cmdline(c)]
            time.sleep(0.1)
        assert workers, f"no llama.cpp worker was seen; the sweep said: {(tmp_path / 'err.txt').read_text()[-2000:]}"
        time.sleep(2.0)  # the model is loaded and the job is measuring
        (worker,) = workers
        group = pgid(worker)
        assert group == worker  # a group of its own, for whatever its engine starts
        family = descendants(p.pid) | in_group(group)
        assert p.poll() is None, "the sweep ended before it was killed"
        p.kill()
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    left = left_after(family, group, timeout_s=30, poll_s=0.2)
    assert not left, [cmdline(x) for x in left]
    assert not list((tmp_path / "k").glob("*/summary.json"))  # the killed job left no result


@pytest.mark.slow
def test_a_divergence_is_weighed_against_the_in_process_engines_own_batch_shapes(code_edit_prompts):
    """A speculative output made to diverge where the baseline's greedy choice is clear: scored in
    the worker's context under six batch shapes, the baseline's token stays far ahead, so the
    divergence stays a failure, with its margins in the detail."""
    import pandas as pd

    from bench.lossless import compare_outputs, weigh_divergences

    b = LlamaCppBackend({"path": "gemma3-270m"}, {"name": "ngram"}, num_speculative_tokens=4)
    try:
        ids = b.tokenize(code_edit_prompts[0])
        r = b.generate([ids], Sampling(), 24, speculative=False).requests[0]
        out_ids = list(r.output_token_ids)
        other = 107 if 107 not in out_ids else 108  # a token the output never chose
        ranked = clearest_decision(b, ids, out_ids, other, start=4)  # positions, clearest first, and their margins
        i, margin_i = ranked[0]
        assert b.margins_across_shapes(ids + out_ids[:i], out_ids[i], out_ids[i], [1, 0]) == [0.0, 0.0]
        # at clear decisions the shapes agree closely: a probe whose cache held the wrong tokens would not
        spreads = [max(m) - min(m) for m in (b.margins_across_shapes(ids + out_ids[:j], out_ids[j], other, [1, 3, 5, 0])
                                            for j, _ in ranked[:4])]
        base = pd.DataFrame({"request_id": ["a"], "repeat": [0], "prompt_token_ids": [ids], "output_token_ids": [out_ids]})
        spec = pd.DataFrame({"request_id": ["a"], "repeat": [0], "output_token_ids": [out_ids[:i] + [other]]})
        cfg = {"temperature": 0.0, "lossless_margin_tol": 0.05, "num_speculative_tokens": 4}
        detail = compare_outputs(cfg, base, spec)[3]
        got = weigh_divergences(b, cfg, base, spec, detail, "job")
    finally:
        b.close()
    assert got == {"lossless": "false", "lossless_divergences": 1, "lossless_near_ties": 0, "lossless_shape_ties": 0}
    d = detail[0]
    assert d["shapes"] == [1, 2, 3, 4, 5, 0] and d["shape_tie"] is False and d["near_tie"] is False
    # the other token stays as far behind under every shape as in one whole-prefix forward (less a little)
    assert margin_i > 1.0 and all(m > margin_i - 1.0 for m in d["margins_across_shapes"]), (margin_i, d)
    assert max(spreads) < 1.0, spreads
