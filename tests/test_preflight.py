"""The sweep's resource pre-flight: a job whose requests overflow the model's context, or whose
engine cannot fit in the memory free, is refused before any model loads (exit 2, the numbers and
what to change), instead of being killed by the kernel's OOM killer after it loaded."""
import json
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from backends.model_facts import model_facts
from backends.native.loading import resolve_model_path
from bench import preflight
from bench.cli import CONF_DIR
from bench.jobspec import check_job


def _cfg(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_the_oom_probe_and_a_context_overflow_are_refused_before_any_model_loads(tmp_path):
    """The probe that once took 7.4 GB and the kernel's OOM killer (max_new_tokens=2,000,000), and
    40,000 tokens past Gemma 3 270M's 32k window: both refused by the pre-check, nothing run."""
    r = subprocess.run([sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", "sweep_name=oom", "method=ngram",
                        "workload=chat", "batch_size=1", "num_prompts=1", "max_new_tokens=2000000,40000"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "2 of 2 jobs have bad input; nothing was run" in r.stderr
    assert "max_new_tokens=2000000 + a draft of 4 need 2000006 positions" in r.stderr
    assert "context window holds 32768 (GGUF gemma3.context_length)" in r.stderr
    assert "lower max_new_tokens (at most 32762 less the prompt)" in r.stderr
    assert not list((tmp_path / "oom").glob("*/summary.json"))


def test_a_set_input_length_counts_against_the_window(tmp_path):
    with pytest.raises(ValueError, match=r"prompt_tokens=32000 \+ max_new_tokens=1000 \+ a draft of 4 need 33006 "
                                         r"positions a request; .*lower max_new_tokens \(at most 762\)"):
        check_job(_cfg("method=ngram", "workload=code_edit", "prompt_tokens=32000", "max_new_tokens=1000",
                       "num_prompts=1", "batch_size=1", f"results_dir={tmp_path}"))


def test_a_job_over_the_memory_free_is_refused_with_its_parts_and_what_to_change(tmp_path, monkeypatch):
    """Native engine, fp32: 1.0 GiB of weights and a static KV cache of 18 layers x 256 x 4 bytes x
    2 (K and V) per position: batch 4 at 30,006 positions is 4.1 GiB of cache."""
    monkeypatch.setattr(preflight, "memory_free", lambda device: 3 * 1024 ** 3)
    overrides = ["method=ngram", "workload=chat", "batch_size=4", "num_prompts=4", "max_new_tokens=30000",
                 f"results_dir={tmp_path}"]
    with pytest.raises(ValueError) as e:
        check_job(_cfg(*overrides))
    msg = str(e.value)
    assert "batch_size=4 with max_new_tokens=30000 needs at least 5.1 GiB of host memory" in msg, msg
    assert "weights 1.00, KV cache 4.12 GiB" in msg and "3.0 GiB is free here" in msg
    assert "backend.dtype=bfloat16" in msg
    check_job(_cfg(*overrides, "backend.dtype=bfloat16", "batch_size=2", "num_prompts=2"))  # 0.5 + 1.03 GiB: fits
    # a derived draft model keeps a cache of its own (its draft_layers of the target's 18)
    monkeypatch.setattr(preflight, "memory_free", lambda device: 6 * 1024 ** 3)
    with pytest.raises(ValueError, match=r"draft KV cache 3\.2"):
        check_job(_cfg(*overrides[1:], "method=draft_model"))
    # and so does a drafter that runs inside another method: combined's neural one, an adaptive policy's
    for inner in (["method=combined", "method.neural=quantized_draft"],
                  ["method=adaptive", "method.policy=match:ngram+draft_model:1:8:4"]):
        with pytest.raises(ValueError, match=r"draft KV cache"):
            check_job(_cfg(*overrides[1:], *inner))


def test_llama_cpp_counts_a_sliding_window_layer_at_its_window_and_its_context_at_its_setting(tmp_path, monkeypatch):
    """llama.cpp keeps a sliding-window layer's cache at the window per sequence (Gemma 3: 15 of 18
    layers at 512), and allocates the whole -c it is given, whatever the job's lengths."""
    facts = model_facts(resolve_model_path("gemma3-270m"))
    assert (facts.n_layers, facts.full_layers, facts.sliding_window, facts.kv_width) == (18, 3, 512, 256)
    assert facts.windowed_kv_bytes(8192, 4, 2) == 2 * 256 * 2 * (3 * 8192 + 15 * 2048)
    monkeypatch.setattr(preflight, "memory_free", lambda device: 1024 ** 3 // 2)
    # -c 8 x 32768: 3 full layers x 262,144 positions + 15 sliding layers x 8 x 512, f16 K and V
    with pytest.raises(ValueError, match=r"needs at least 1\.0 GiB of host memory \(weights 0\.24, KV cache 0\.81 GiB\)"
                                         r".*or a smaller backend\.ctx_per_slot"):
        check_job(_cfg("backend=llamacpp_server", "method=ngram", "workload=chat", "batch_size=8", "num_prompts=8",
                       "max_new_tokens=64", "backend.ctx_per_slot=32768", f"results_dir={tmp_path}"))


def test_the_facts_of_a_hugging_face_folder_come_from_its_config_and_safetensors_headers(tiny_llama):
    cfg = json.loads((tiny_llama / "config.json").read_text())
    facts = model_facts(tiny_llama)
    assert facts.context_tokens == cfg["max_position_embeddings"]
    assert facts.n_layers == cfg["num_hidden_layers"]
    from safetensors import safe_open

    with safe_open(str(next(tiny_llama.glob("*.safetensors"))), "pt") as f:
        assert facts.params == sum(f.get_tensor(k).numel() for k in f.keys())


def test_a_deployment_or_an_engine_sizing_its_own_memory_is_held_to_the_context_only(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "memory_free", lambda device: 0)  # never asked: no memory parts
    check_job(_cfg("backend=vllm", "method=ngram", "workload=chat", "batch_size=1", "num_prompts=1",
                   "max_new_tokens=64", f"results_dir={tmp_path}"))
    with pytest.raises(ValueError, match="context window holds 32768"):
        check_job(_cfg("backend=vllm", "method=ngram", "workload=chat", "batch_size=1", "num_prompts=1",
                       "max_new_tokens=40000", "backend.max_model_len=65536", f"results_dir={tmp_path}"))


def test_a_model_file_that_is_not_gguf_is_refused_by_the_pre_check_naming_it(tmp_path):
    fake = tmp_path / "notes.gguf"
    fake.write_text("these are my notes, not a model")
    with pytest.raises(ValueError, match=r"model file '.*notes.gguf' is not a readable GGUF file"):
        check_job(_cfg("model=local", f"model.path={fake}", "method=ngram", "workload=chat", f"results_dir={tmp_path}"))
