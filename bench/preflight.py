"""What the sweep's pre-check holds every job to before any model loads (bench/jobspec.py's
check_job runs these): the rows and the context the engine's settings hold, the model's own context
window, and the memory the job will take against the memory free. Each failure is a ValueError
naming the values and what to change; the sweep then runs nothing (exit status 2)."""
from __future__ import annotations

from .backend import checked_settings

GIB = 1024 ** 3


def check_rows(c: dict, adapter, settings: dict) -> None:
    """The rows a job runs at once (batch_size; under load the plan's, which load.normalize put in
    batch_size) within the adapter's cap on them, where its config declares one (rows_setting)."""
    key = getattr(getattr(adapter, "config_cls", None), "rows_setting", None)
    if not key:
        return
    limit = getattr(checked_settings(settings, adapter.config_cls, c["backend"].get("name")), key)
    rows = int(c["batch_size"])
    if rows > limit:
        load_cfg = c.get("load") or {}
        what = (f"load.level={load_cfg.get('level')}" if load_cfg.get("kind") == "concurrency"
                else f"load.max_rows={load_cfg.get('max_rows')}" if load_cfg.get("kind") == "rate"
                else f"batch_size={rows}")
        raise ValueError(f"{what} runs {rows} requests at once; backend.{key}={limit} holds fewer: raise it "
                         f"(backend.{key}={rows}) or lower the rows")


def check_context(c: dict, adapter, settings: dict) -> None:
    """At a set input length (prompt_tokens), every request's tokens (its prompt, its output and a
    draft past it) within the adapter's context setting, per row or shared by a batch's rows, where
    its config declares one (context_setting)."""
    cls = getattr(adapter, "config_cls", None)
    key = getattr(cls, "context_setting", None)
    if not key or not c.get("prompt_tokens"):
        return
    limit = getattr(checked_settings(settings, cls, c["backend"].get("name")), key)
    per_row = c["prompt_tokens"] + c["max_new_tokens"] + c["num_speculative_tokens"] + 2
    rows = int(c["batch_size"]) if cls.context_shared_by_rows else 1
    if per_row * rows > limit:
        shared = f" x {rows} rows (batch_size; the rows share it)" if rows > 1 else ""
        raise ValueError(f"prompt_tokens={c['prompt_tokens']} + max_new_tokens={c['max_new_tokens']} + a draft of "
                         f"{c['num_speculative_tokens']} need {per_row} tokens{shared}; backend.{key}={limit} holds "
                         f"fewer: raise it (backend.{key}={per_row * rows}) or shorten the lengths")


def tokens_per_row(c: dict) -> int:
    """The positions one request holds at most: its prompt (at a set input length; the workloads'
    own prompts are not counted, so this is a floor), its output and a padded draft past it."""
    return int(c.get("prompt_tokens") or 0) + int(c["max_new_tokens"]) + int(c["num_speculative_tokens"]) + 2


def memory_free(device: str) -> int:
    """Bytes free for a new allocation: the host's available memory (MemAvailable: free plus what
    the kernel can reclaim) for cpu, the device's free memory for cuda[:N]."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    import psutil

    return psutil.virtual_memory().available


def check_resources(c: dict, adapter, settings: dict, method: dict) -> None:
    """The job's requests within the model's context window, and the memory its engine will hold
    (Backend.resource_need: a floor) within the memory free."""
    need_tokens = tokens_per_row(c)
    rows = int(c["batch_size"])
    need = adapter.resource_need(settings, c["model"], method, int(c["num_speculative_tokens"]), rows, need_tokens)
    prompt = f"prompt_tokens={c['prompt_tokens']} + " if c.get("prompt_tokens") else ""
    if need.context_tokens and need_tokens > need.context_tokens:
        room = need.context_tokens - need_tokens + int(c["max_new_tokens"])
        raise ValueError(
            f"{prompt}max_new_tokens={c['max_new_tokens']} + a draft of {c['num_speculative_tokens']} need "
            f"{need_tokens} positions a request{'' if prompt else ' (more with its prompt)'}; model "
            f"{c['model'].get('name')}'s context window holds {need.context_tokens} ({need.context_source}): "
            + (f"lower max_new_tokens (at most {room}{' less the prompt' if not prompt else ''})" if room > 0 else
               "shorten prompt_tokens"))
    total = sum(need.memory_bytes.values())
    if not total:
        return
    free = memory_free(need.memory_device)
    if total > free:
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in need.memory_bytes.items())
        where = "host memory" if need.memory_device == "cpu" else f"{need.memory_device} memory"
        raise ValueError(
            f"batch_size={rows} with max_new_tokens={c['max_new_tokens']} needs at least {total / GIB:.1f} GiB of {where} "
            f"({parts} GiB), and {free / GIB:.1f} GiB is free here: lower batch_size (or the load level), "
            f"max_new_tokens or prompt_tokens" + (f", or {need.advice}" if need.advice else ""))
