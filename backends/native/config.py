"""backend=native's settings: a module of its own, without torch, because bench/config.py
registers every adapter's settings as a Hydra node when the CLI starts (torch is imported when a
native job runs, not for `specsweep --help` or a sweep of other engines)."""
from __future__ import annotations

from dataclasses import dataclass

from bench.backend import BackendConfig

# torch.compile modes a compiled decode/verify step may run in (backend.compile); "reduce-overhead"
# replays CUDA graphs, as gpt-fast's decode does
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class NativeConfig(BackendConfig):
    """backend=native: the native PyTorch engine (backends/native)."""
    _target_: str = "backends.native.NativeBackend"
    name: str = "native"
    dtype: str = "float32"  # float32 | bfloat16 | float16 (bf16 is slower on AVX2 CPUs)
    device: str = "cpu"  # cpu | cuda | cuda:N
    threads: int | None = None  # torch threads; null = torch's default
    trace: bool = True  # per-cycle trace (cycles.parquet)
    # null (eager) | default | reduce-overhead (CUDA graphs) | max-autotune | max-autotune-no-cudagraphs:
    # torch.compile of the decode/verify steps, gpt-fast style (COMPILE_MODES); prefill stays
    # eager. Costs a compile per new shape (tens of seconds on a 2-core CPU), so it pays on long runs.
    compile: str | None = None

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"backend.dtype={self.dtype!r} is not valid; use float32, bfloat16 or float16")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"backend.device={self.device!r} is not valid; use cpu or cuda[:N]")
        if self.device.startswith("cuda") and not _cuda_available():
            raise ValueError(f"backend.device={self.device!r} but CUDA is not available here; use backend.device=cpu")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"backend.threads={self.threads} is not valid; use a positive count or null (torch's default)")
        if self.compile is not None and self.compile not in COMPILE_MODES:
            raise ValueError(f"backend.compile={self.compile!r} is not valid; use null (eager) or one of {', '.join(COMPILE_MODES)}")
