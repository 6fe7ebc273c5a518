"""Engine adapters, one per engine. Each implements bench.backend.Backend.

CONFIGS: every adapter's settings dataclass (a bench.backend.BackendConfig), which bench/config.py
registers as the typed Hydra node `backend=<its name>`; the settings and their defaults are written
there once. Variants that share an adapter's settings (the server modes of vLLM and SGLang) derive
from its node in conf/backend/<name>.yaml."""

CONFIGS = (
    "backends.native.config.NativeConfig",
    "backends.llamacpp.LlamaCppConfig",
    "backends.llamacpp_server.LlamaServerConfig",
    "backends.vllm.VLLMConfig",
    "backends.sglang.SGLangConfig",
    "backends.openai_endpoint.EndpointConfig",
)
