"""Prompt sources, all offline. `load_prompts(name, num_prompts, seed, **params)` returns a
deterministic choice of prompts for a workload; each workload applies its own prompt template
(the default model is a base model: plain-text completion prompts, no chat template)."""
from __future__ import annotations

from .sources import WORKLOAD_SETTINGS, WORKLOADS, Prompt, Workload, WorkloadError, WorkloadUnavailable, load_prompts

__all__ = ["WORKLOAD_SETTINGS", "WORKLOADS", "Prompt", "Workload", "WorkloadError", "WorkloadUnavailable",
           "load_prompts"]
