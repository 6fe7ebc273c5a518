"""TensorRT-LLM deployments (backend=trtllm_endpoint, and openai_endpoint recognizing trtllm-serve).
TensorRT-LLM needs an NVIDIA GPU, so these tests drive A STAND-IN SERVER of their own
(tests/trtllm_standin.py) that answers in trtllm-serve's formats as read from its source: its
/v1/models owner, its streamed completions (text only, avg_decoded_tokens_per_iter), its /metrics
iteration statistics drained on every read. The stand-in knows the truth of what it drafted and
accepted, so the figures the harness reads are checked against it exactly."""
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hydra import compose, initialize_config_dir

from backends.processes import free_port
from backends.tensorrt_llm import TRTLLMEndpointBackend, speculative_config
from bench.cli import CONF_DIR

STANDIN = Path(__file__).resolve().parent / "trtllm_standin.py"
K = 3


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer trained here (bench.tiny_models), standing in for the served model's."""
    from bench.tiny_models import train_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer().save(str(path))
    return path


class StandIn:
    def __init__(self, tokenizer: Path, k: int = 0, iter_stats: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, str(STANDIN), "--port", str(self.port), "--tokenizer", str(tokenizer), "--k", str(k)]
        self.proc = subprocess.Popen(args + (["--iter-stats"] if iter_stats else []))
        for _ in range(100):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the TensorRT-LLM stand-in did not start")

    def truth(self) -> dict:
        return httpx.get(self.url + "/standin/truth").json()

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def servers(tokenizer):
    spec, base = StandIn(tokenizer, k=K), StandIn(tokenizer)
    yield spec, base
    spec.stop()
    base.stop()


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[f"results_dir={tmp_path}", "sweep_name=trt", "report=false", *overrides])


def test_a_job_on_a_trtllm_standin_reads_acceptance_from_its_drained_iteration_stats(servers, tokenizer, tmp_path):
    """A whole job against the stand-in: the prompts tokenized by the given tokenizer, the streamed
    text turned back into ids, the baseline and the method alike (lossless), and acceptance the
    stand-in's own truth to the token, though the server empties its statistics on every read and
    held iterations of another request from before the job (drained, not counted)."""
    from bench.runner import run_job

    spec, base = servers
    warm = {"model": "standin", "prompt": [5, 6, 7, 8], "max_tokens": 9, "stream": True}
    with httpx.stream("POST", spec.url + "/v1/completions", json=warm) as r:  # iterations left in its queue
        assert r.status_code == 200 and r.read()
    before = spec.truth()
    assert before["numDraftTokens"] > 0
    row = run_job(_cfg(tmp_path, "backend=trtllm_endpoint", f"backend.url={spec.url}", f"backend.baseline_url={base.url}",
                       f"backend.tokenizer={tokenizer}", "method=ngram", f"num_speculative_tokens={K}",
                       "workload=code_edit", "batch_size=2", "num_prompts=4", "max_new_tokens=20", "repeats=1",
                       "warmup=false"))
    assert row["status"] == "ok", row.get("error")
    after = spec.truth()
    drafts, drafted, accepted = (after[f] - before[f] for f in ("numRequestsWithDraftTokens", "numDraftTokens",
                                                               "numAcceptedTokens"))
    assert drafted > 0 and 0 < accepted < drafted
    assert row["acceptance_rate"] == pytest.approx(accepted / drafted, abs=1e-12)
    assert row["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts, abs=1e-12)
    assert row["per_position_acceptance"] == []  # trtllm-serve keeps no per-position record: none invented
    assert row["lossless"] == "true"
    summary = json.loads((tmp_path / "trt" / row["job"] / "summary.json").read_text())
    assert "TensorRT-LLM" in summary["engine"]["engine"]
    assert "iteration statistics" in summary["engine"]["acceptance_source"]


def test_a_trtllm_standin_without_iteration_stats_leaves_acceptance_empty_and_says_how(tokenizer, tmp_path):
    from bench.runner import run_job

    spec, base = StandIn(tokenizer, k=K, iter_stats=False), StandIn(tokenizer)
    try:
        row = run_job(_cfg(tmp_path, "backend=openai_endpoint", f"backend.url={spec.url}",
                           f"backend.baseline_url={base.url}", f"backend.tokenizer={tokenizer}", "method=ngram",
                           f"num_speculative_tokens={K}", "workload=chat", "batch_size=1", "num_prompts=2",
                           "max_new_tokens=12", "repeats=1", "warmup=false"))
    finally:
        spec.stop()
        base.stop()
    assert row["status"] == "ok", row.get("error")
    assert row["acceptance_rate"] != row["acceptance_rate"]  # NaN: nothing read, nothing made up
    summary = json.loads((tmp_path / "trt" / row["job"] / "summary.json").read_text())
    assert "enable_iter_perf_stats: true" in summary["engine"]["acceptance_source"]


def test_a_trtllm_standin_needs_the_served_models_tokenizer(servers, tokenizer, tmp_path):
    spec, base = servers
    with pytest.raises(ValueError, match=r"is TensorRT-LLM's trtllm-serve, which tokenizes nothing .* backend.tokenizer=PATH"):
        TRTLLMEndpointBackend({"path": "unused"}, {"name": "ngram"}, url=spec.url, baseline_url=base.url)
    with pytest.raises(ValueError, match=r"backend.tokenizer='/nowhere' is neither a tokenizer.json nor a folder"):
        TRTLLMEndpointBackend({"path": "unused"}, {"name": "ngram"}, url=spec.url, baseline_url=base.url,
                              tokenizer="/nowhere")


def test_trtllm_speculative_config_in_its_own_syntax():
    """Tuned configs for TensorRT-LLM: the line for the file given to --extra_llm_api_options, with
    the decoding_type and keys its config classes declare (tensorrt_llm/llmapi/llm_args.py)."""
    line = TRTLLMEndpointBackend.engine_config({"name": "ngram", "max_ngram": 3, "prefer_recent": True}, 4)
    assert line[0].startswith("speculative_config: ")
    assert json.loads(line[0].split(": ", 1)[1]) == {"decoding_type": "NGram", "max_draft_len": 4,
                                                       "max_matching_ngram_size": 3, "is_use_oldest": False}
    assert TRTLLMEndpointBackend.engine_config({"name": "ngram"}, None) == []
    assert speculative_config({"name": "eagle3", "head_path": "/heads/e3"}, 5) == {
        "decoding_type": "Eagle3", "max_draft_len": 5, "speculative_model": "/heads/e3"}
    assert speculative_config({"name": "draft_model", "draft_path": "/m/small"}, 4)["decoding_type"] == "DraftTarget"
    assert speculative_config({"name": "mtp"}, 2) == {"decoding_type": "MTP", "max_draft_len": 2}
    with pytest.raises(ValueError, match="needs method.draft_path"):
        speculative_config({"name": "draft_model"}, 4)
    with pytest.raises(ValueError, match=r"method 'suffix' has no TensorRT-LLM speculative_config here; it maps ngram"):
        speculative_config({"name": "suffix"}, 4)
