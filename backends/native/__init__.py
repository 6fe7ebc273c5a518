"""The native PyTorch engine: a compact decoder, drafters and the draft/verify loop.

The engine (and torch) loads on first use of NativeBackend or METHODS, so that importing its
settings (backends.native.config) costs no torch import."""
from .config import NativeConfig

__all__ = ["METHODS", "NativeBackend", "NativeConfig"]


def __getattr__(name: str):
    if name in ("METHODS", "NativeBackend"):
        from . import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
