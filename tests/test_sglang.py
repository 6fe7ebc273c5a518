"""backend=sglang / sglang_server. SGLang cannot run on this CPU (its kernels on PyPI are CUDA
builds), so most tests here use FIXTURES SHAPED AFTER SGLANG'S SOURCE (0.5.23): meta_info as
tokenizer_manager._calculate_spec_decoding_metrics builds it, the per-request acceptance
histogram of schedule_batch.Req.update_spec_correct_drafts_histogram, and the /metrics counters
of observability/metrics_collector.py. The real-engine test runs only where CUDA and sglang are
present, and is reported as skipped otherwise."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.sglang import (SGLangBackend, SGLangConfig, batch_counters, engine_args, metrics_counters,
                             request_counts, request_output, sglang_python, speculative_args)
from bench import metrics

K = 3


def sglang_shaped_meta(accepted_per_verify: list[int], k: int = K, finish: str = "length") -> dict:
    """A finished request's meta_info as SGLang builds it, from the drafts each verify accepted
    (bonus excluded): verify count, proposed = verify x (num_draft_tokens - 1), correct drafts,
    the histogram, and completion_tokens = the prefill's token + every verify's accepted + bonus."""
    verify = len(accepted_per_verify)
    completion = 1 + sum(a + 1 for a in accepted_per_verify)
    meta = {"id": "r", "finish_reason": {"type": finish}, "prompt_tokens": 12, "completion_tokens": completion,
            "e2e_latency": 0.5, "first_token_latency": 0.05}
    if verify:
        hist = [0] * (max(accepted_per_verify) + 1)
        for a in accepted_per_verify:
            hist[a] += 1
        proposed = verify * k
        meta.update(spec_accept_rate=sum(accepted_per_verify) / proposed, spec_accept_length=completion / verify,
                    spec_num_correct_drafts=sum(accepted_per_verify), spec_num_proposed_drafts=proposed,
                    spec_verify_ct=verify, spec_correct_drafts_histogram=hist)
    return meta


def test_meta_info_becomes_counts_per_request_and_position():
    verify, drafted, accepted, per_pos = request_counts(sglang_shaped_meta([3, 0, 1, 2, 3]), K)
    assert (verify, drafted, accepted) == (5, 15, 9)
    assert per_pos == [4, 3, 2]  # position 1 accepted in the 4 verifies accepting >= 1, ...
    assert sum(per_pos) == accepted


def test_request_without_a_verify_has_no_counts():
    assert request_counts(sglang_shaped_meta([]), K) == (0, 0, 0, [0, 0, 0])


def test_batch_counters_map_to_design_metrics_and_differ_from_sglangs_accept_length_as_documented():
    metas = [sglang_shaped_meta([3, 3, 1]), sglang_shaped_meta([0, 2]), sglang_shaped_meta([])]
    c = batch_counters(metas, K)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position) == (5, 15, 9, [4, 3, 2])
    m = metrics.counters_metrics(c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position, K)
    assert m["acceptance_rate"] == pytest.approx(9 / 15)
    assert m["mean_acceptance_length"] == pytest.approx(1 + 9 / 5)
    assert m["per_position_acceptance"] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    # SGLang's own spec_accept_length counts the prefill's token too: 1/verify_ct more per request
    one = metas[0]
    ours = 1 + one["spec_num_correct_drafts"] / one["spec_verify_ct"]
    assert one["spec_accept_length"] - ours == pytest.approx(1 / one["spec_verify_ct"])
    # and its spec_accept_rate is ours (strict: bonus excluded, over proposed drafts)
    assert one["spec_accept_rate"] == pytest.approx(request_counts(one, K)[2] / request_counts(one, K)[1])


def test_request_output_reads_ids_latencies_and_finish_reason():
    d = {"output_ids": [5, 6, 7], "meta_info": sglang_shaped_meta([2], finish="stop")}
    r = request_output(d, 0.9, True, K)
    assert r.output_token_ids == [5, 6, 7] and r.finished_by == "eos"
    assert (r.ttft_s, r.e2e_s, r.drafted, r.accepted) == (0.05, 0.5, 3, 2)
    base = request_output({"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}}, 0.7, False, K)
    assert base.finished_by == "length" and base.e2e_s == 0.7 and base.drafted is None


def test_metrics_page_counters_summed_over_labels():
    page = "\n".join([
        "# HELP sglang:spec_verify_calls_total Number of speculative decoding verification calls.",
        "# TYPE sglang:spec_verify_calls_total counter",
        'sglang:spec_verify_calls_total{model_name="m"} 17.0',
        "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
        "# TYPE sglang:generation_tokens_total counter",
        'sglang:generation_tokens_total{is_streaming="false",model_name="m"} 40.0',
        'sglang:generation_tokens_total{is_streaming="true",model_name="m"} 2.0',
        "# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.",
        "# TYPE sglang:spec_accept_length gauge",
        'sglang:spec_accept_length{model_name="m"} 2.4',
    ]) + "\n"
    got = metrics_counters(page)
    assert got == {"sglang:spec_verify_calls_total": 17.0, "sglang:generation_tokens_total": 42.0}


def test_methods_map_to_sglang_arguments():
    assert speculative_args({"name": "autoregressive"}, K) == {}
    assert speculative_args({"name": "ngram"}, K) == {"speculative_algorithm": "NGRAM", "speculative_num_steps": 3,
                                                     "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
    a = speculative_args({"name": "eagle3", "head_path": "/h"}, 5)
    assert a["speculative_algorithm"] == "EAGLE3" and a["speculative_draft_model_path"] == "/h"
    assert speculative_args({"name": "draft_model", "draft_path": "/d"}, 2)["speculative_algorithm"] == "STANDALONE"


# ServerArgs fields the adapter sets, as SGLang 0.5.23 declares them (srt/arg_groups/field_order.py)
SGLANG_FIELDS = {"model_path", "dtype", "context_length", "max_running_requests", "mem_fraction_static",
                 "disable_cuda_graph", "random_seed", "speculative_algorithm", "speculative_num_steps",
                 "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_draft_model_path"}


def test_engine_arguments_are_sglang_server_args_fields():
    for method in ({"name": "autoregressive"}, {"name": "ngram"}, {"name": "eagle3", "head_path": "/h"},
                   {"name": "draft_model", "draft_path": "/d"}):
        assert set(engine_args("/m", SGLangConfig(), speculative_args(method, K))) <= SGLANG_FIELDS


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="'layer_skip' is not supported by backend sglang; it supports"):
        speculative_args({"name": "layer_skip"}, K)
    with pytest.raises(ValueError, match="needs method.head_path"):
        speculative_args({"name": "eagle"}, K)
    with pytest.raises(ValueError, match="mem_fraction_static=1.5"):
        SGLangConfig(mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="dtype='fp8'"):
        SGLangConfig(dtype="fp8")


@pytest.mark.skipif(subprocess.run([sys.executable, "-c", "import sglang"], capture_output=True).returncode == 0,
                    reason="sglang is installed here")
def test_missing_sglang_says_what_to_do():
    with pytest.raises(ValueError, match="no SGLang in .*needs a CUDA GPU"):
        sglang_python(None)


def _has_sglang_and_cuda() -> bool:
    return torch.cuda.is_available() and subprocess.run([sys.executable, "-c", "import sglang"],
                                                        capture_output=True).returncode == 0


@pytest.mark.gpu
@pytest.mark.skipif(not _has_sglang_and_cuda(), reason="needs CUDA and sglang (SGLang does not run on CPU)")
@pytest.mark.parametrize("server", [False, True])
def test_real_sglang_self_draft_accepts_every_token(tmp_path, server):
    """Real SGLang on a GPU, on a random-weight Llama built here: a draft model equal to the target
    accepts every draft, greedy output equals the baseline, and n-gram drafting runs."""
    from backends.processes import Pool
    from backends.sglang import SGLangServerBackend
    from bench.backend import Sampling
    from bench.tiny_models import build_tiny_llama

    folder = build_tiny_llama(tmp_path / "tiny", hidden=256, heads=4, kv_heads=2, layers=8)
    cls = SGLangServerBackend if server else SGLangBackend
    kw = {"mem_fraction_static": 0.3, "context_length": 1024, "max_running_requests": 4}
    b = cls({"path": str(folder)}, {"name": "draft_model", "draft_path": str(folder)}, num_speculative_tokens=3, **kw)
    b.set_artifact_dir(tmp_path)
    ids = [b.tokenize("def foo(x):\n    return x + 1\n"), b.tokenize("import os\nimport sys\n")]
    base = b.generate(ids, Sampling(), 24, speculative=False)
    spec = b.generate(ids, Sampling(), 24, speculative=True)
    assert [r.output_token_ids for r in spec.requests] == [r.output_token_ids for r in base.requests]
    c = spec.spec_counters
    assert c.draft_tokens > 0 and c.accepted_tokens == c.draft_tokens
    ng = cls({"path": str(folder)}, {"name": "ngram"}, num_speculative_tokens=3, **kw)
    ng.set_artifact_dir(tmp_path)
    out = ng.generate(ids, Sampling(), 24, speculative=True)
    assert out.spec_counters.drafts > 0 and not math.isnan(out.wall_s)
    Pool.stop_all()


# --- load runs: /generate streamed, against a stand-in server ------------------------------------
# SGLang cannot run here, so these tests talk to a small HTTP server of the test's own that streams
# what SGLang's http_server.generate_request and tokenizer_manager._handle_batch_output send for
# stream=True: `data: {"output_ids", "meta_info"}` per output chunk (output_ids the whole output so
# far by default, only the new ones under --incremental-streaming-output; meta_info with
# completion_tokens, the count so far), `data: [DONE]`, and on a finished request the
# speculative fields of sglang_shaped_meta.

class MockSGLangStream:
    """Greedy 'generation' that depends only on the prompt: token i = (sum(prompt) + i) % 1000,
    emitted in chunks of CHUNKS tokens as verify cycles would; one accepted draft fewer than each
    chunk's size, so the acceptance record is known."""
    CHUNKS = (1, 3, 2, 4)

    def __init__(self, incremental: bool = False, fail: str | None = None):
        import http.server
        import json as _json
        import threading

        mock = self
        self.incremental, self.fail, self.verify_calls, self.in_flight, self.most_in_flight = incremental, fail, 0, 0, 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a):
                pass

            def do_GET(self):  # /metrics: the verify-call counter, Prometheus text
                page = f"# TYPE sglang:spec_verify_calls_total counter\nsglang:spec_verify_calls_total {mock.verify_calls}\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(page.encode())

            def do_POST(self):
                import time as _time

                body = _json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert body["stream"] is True and "input_ids" in body
                n = body["sampling_params"]["max_new_tokens"]
                toks = [(sum(body["input_ids"]) + i) % 1000 for i in range(n)]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                mock.in_flight += 1
                mock.most_in_flight = max(mock.most_in_flight, mock.in_flight)
                sent, accepted, j = 0, [], 0
                while sent < n:
                    size = min(mock.CHUNKS[j % len(mock.CHUNKS)], n - sent)
                    if j:  # every chunk after the prefill's first token is one verify
                        accepted.append(size - 1)
                    j += 1
                    new = toks[sent:sent + size]
                    sent += size
                    meta = {"id": "r", "finish_reason": None, "completion_tokens": sent, "prompt_tokens": len(body["input_ids"])}
                    if sent == n:
                        meta = sglang_shaped_meta(accepted)
                        meta["completion_tokens"] = sent
                        if mock.fail == "abort":
                            meta["finish_reason"] = {"type": "abort", "message": "context length exceeded"}
                    chunk = {"output_ids": new if mock.incremental else toks[:sent], "meta_info": meta}
                    if mock.fail == "error" and sent == n:
                        chunk = {"error": {"message": "the engine fell over"}}
                    self.wfile.write(b"data: " + _json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                    _time.sleep(0.01)
                self.wfile.write(b"data: [DONE]\n\n")
                mock.verify_calls += len(accepted)
                mock.in_flight -= 1

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def counters(self) -> dict:
        import httpx

        return metrics_counters(httpx.get(self.url + "/metrics").text)

    def log_tail(self) -> str:
        return "(the stand-in server keeps no log)"

    def close(self):
        self.server.shutdown()


@pytest.mark.parametrize("incremental", [False, True])
def test_streamed_generate_under_load_against_a_mock_sglang_server(incremental):
    """Both of SGLang's streaming forms give the same output, a time per chunk, the client's TTFT
    and the finished chunk's acceptance record; a closed loop of 2 holds 2 in flight."""
    from backends.serving import serve_load
    from bench.backend import LoadPlan, Sampling

    srv = MockSGLangStream(incremental)
    try:
        prompts = [[1, 2, 3], [7, 8], [5], [9, 9, 9, 9]]
        reqs, wall = serve_load("sglang_stream", srv.url, prompts, Sampling(), 10,
                                LoadPlan("concurrency", max_rows=2, concurrency=2), 10.0, "SGLang's server", k=K)
    finally:
        srv.close()
    assert srv.most_in_flight == 2
    for p, r in zip(prompts, reqs):
        assert r.output_token_ids == [(sum(p) + i) % 1000 for i in range(10)]
        assert len(r.emit_times_s) == 4 and r.ttft_s == r.emit_times_s[0] < r.e2e_s == r.emit_times_s[-1] <= wall
        # chunks of 1, 3, 2, 4: verifies accepted 2, 1, 3 drafts of K each
        assert (r.spec_counters.drafts, r.spec_counters.draft_tokens, r.spec_counters.accepted_tokens) == (3, 3 * K, 6)
        assert r.finished_by == "length"


@pytest.mark.parametrize("fail, expected", [("error", "streamed an error: .*the engine fell over"),
                                            ("abort", "aborted a request: context length exceeded")])
def test_a_streamed_error_or_abort_from_a_mock_sglang_server_is_an_engine_error(fail, expected):
    from backends.serving import serve_load
    from bench.backend import BackendError, LoadPlan, Sampling

    srv = MockSGLangStream(fail=fail)
    try:
        with pytest.raises(BackendError, match=expected):
            serve_load("sglang_stream", srv.url, [[1, 2]], Sampling(), 6, LoadPlan("concurrency", max_rows=1, concurrency=1),
                       10.0, "SGLang's server", k=K)
    finally:
        srv.close()


def test_sglang_server_serves_a_load_streamed_with_a_client_latency_contract_against_a_mock_server(http_bodies):
    """SGLangServerBackend.serve on the stand-in server (its process replaced by the mock: SGLang
    cannot start here): the /metrics cross-check agrees with the requests' meta_info, after a
    load the contract says client TTFT, chunk granularity, and the baseline arm sends the same
    request bodies as the method arm."""
    from backends.sglang import SGLangServerBackend
    from bench.backend import LoadPlan, Sampling

    srv = MockSGLangStream()
    b = object.__new__(SGLangServerBackend)  # no SGLang to start: the adapter's state set by hand
    b.cfg, b.k, b.spec, b.method = SGLangConfig(), K, speculative_args({"name": "ngram"}, K), {"name": "ngram"}
    b._engine = lambda speculative, rows: srv
    try:
        assert b.latency_contract() == {"ttft_source": "engine", "emit_granularity": "none"}
        out = b.serve([[1, 2], [3]], Sampling(), 6, True, LoadPlan("rate", max_rows=2, arrivals_s=[0.0, 0.05]))
        b.serve([[1, 2], [3]], Sampling(), 6, False, LoadPlan("rate", max_rows=2, arrivals_s=[0.0, 0.05]))
    finally:
        srv.close()
    bodies = [body for _, path, body in http_bodies if path == "/generate"]
    assert len(bodies) == 4 and bodies[:2] == bodies[2:]
    assert out.spec_counters.drafts == sum(r.spec_counters.drafts for r in out.requests) > 0
    assert out.counters["verify_calls_match_meta_info"] is True
    assert out.requests[1].submitted_s >= 0.04
    assert b.latency_contract() == {"ttft_source": "client", "emit_granularity": "chunk"}


# --- a key for a server specsweep starts: a stand-in launch_server process ------------------------
# SGLang cannot start here, so `python -m sglang.launch_server` runs a stand-in package of the
# test's own, with launch_server's argument names (--port, --config: the YAML that SGLang's
# srt/utils/server_args_config_parser.py reads) and the check of SGLang's add_api_key_middleware
# (every path but /health and /metrics wants `Authorization: Bearer <key>`, else 401).

STAND_IN_LAUNCH_SERVER = '''
import http.server, json, os, sys
import yaml

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
config = args[args.index("--config") + 1] if "--config" in args else None
key = yaml.safe_load(open(config))["api-key"] if config else None
if config:
    print("config file mode", oct(os.stat(config).st_mode & 0o777), "folder mode",
          oct(os.stat(os.path.dirname(config)).st_mode & 0o777), flush=True)


class Handler(http.server.BaseHTTPRequestHandler):
    def _send(self, code, body):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, "" if self.path.startswith("/metrics") else "ok")

    def do_POST(self):
        q = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if key and self.headers.get("Authorization") != "Bearer " + key:
            return self._send(401, json.dumps({"error": "Unauthorized"}))
        n = q["sampling_params"]["max_new_tokens"]
        out = [(sum(q["input_ids"]) + i) % 1000 for i in range(n)]
        self._send(200, json.dumps({"output_ids": out, "meta_info": {"completion_tokens": n,
                                                                      "finish_reason": {"type": "length"}}}))

    def log_message(self, *a):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_sglang_server_gets_its_key_in_a_private_config_file_against_a_stand_in_launch_server(tiny_llama, tmp_path,
                                                                                             monkeypatch):
    """backend=sglang_server with backend.api_key_env: the server is started wanting the key, which
    reaches it in a --config YAML readable by this user only and deleted once the server is up (not
    on its command line, not in its log); every request sends it. Offline sglang refuses the setting."""
    from backends.processes import Pool
    from backends.sglang import SGLangServerBackend
    from bench.backend import Sampling

    package = tmp_path / "stand_in" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(STAND_IN_LAUNCH_SERVER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={package.parent} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    key = "sk-test-7f3a9c"
    monkeypatch.setenv("SGL_TEST_KEY", key)
    b = SGLangServerBackend({"path": str(tiny_llama)}, {"name": "ngram"}, num_speculative_tokens=K, python=str(python),
                            api_key_env="SGL_TEST_KEY", startup_timeout_s=60)
    b.set_artifact_dir(tmp_path / "logs")
    (tmp_path / "logs").mkdir()
    try:
        out = b.generate([[1, 2, 3], [4]], Sampling(), 5, speculative=False)  # the stand-in answers 401 without it
        server = next(iter(Pool.live.values()))
        config = server.cmd[server.cmd.index("--config") + 1]
    finally:
        Pool.stop_all()
    assert [r.output_token_ids for r in out.requests] == [[6, 7, 8, 9, 10], [4, 5, 6, 7, 8]]
    assert key not in " ".join(server.cmd) and not Path(config).exists() and not Path(config).parent.exists()
    log = (tmp_path / "logs" / "sglang_server-baseline.log").read_text()
    assert "config file mode 0o600 folder mode 0o700" in log and key not in log
    with pytest.raises(ValueError, match="runs SGLang in process, with no server to protect; use backend=sglang_server"):
        SGLangBackend.check_config({"api_key_env": "SGL_TEST_KEY"}, {"path": str(tiny_llama)}, {"name": "ngram"}, K)
    monkeypatch.delenv("SGL_TEST_KEY")
    with pytest.raises(ValueError, match="environment variable SGL_TEST_KEY holds no key here"):
        SGLangServerBackend.check_config({"api_key_env": "SGL_TEST_KEY"}, {"path": str(tiny_llama)}, {"name": "ngram"}, K)
