"""vLLM general plugin: per-step draft/verify timing for specsweep (see pyproject.toml here)."""
import os

VERSION = 1  # the adapter checks this; bump when register()'s contract changes


def register():
    path = os.environ.get("SPECSWEEP_VLLM_STEP_LOG")
    if path:
        from backends.vllm_timing import install  # from the specsweep checkout on PYTHONPATH

        install(path)
