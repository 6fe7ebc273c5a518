"""The native PyTorch engine: a compact decoder, drafters and the draft/verify loop."""
from .backend import METHODS, NativeBackend, NativeConfig

__all__ = ["METHODS", "NativeBackend", "NativeConfig"]
