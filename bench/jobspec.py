"""One job's settings, checked once (JobSpec), and every check the sweep's pre-check runs before
any job (check_job): Hydra's config, the backend's support for the method and load, the results
folder, the rows and the context the engine holds, the workload's prompts. A ValueError (or
FileNotFoundError) names the bad value and what is valid, before any model loads."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from workloads import WorkloadUnavailable, load_prompts

from . import load
from .config import ConfigError, validate
from .methods import split_method_keys
from .preflight import check_context, check_resources, check_rows
from .results import job_name


def check_backend_supports(c: dict) -> None:
    cls = get_class(c["backend"]["_target_"])
    supported = getattr(cls, "supported_methods", ())
    if supported and c["method"]["name"] not in supported:
        raise ConfigError(f"method {c['method']['name']!r} is not supported by backend {c['backend']['name']!r}; "
                          f"it supports {', '.join(supported)}")
    kind = (c.get("load") or {}).get("kind", "static")
    if kind != "static" and kind not in getattr(cls, "load_kinds", ()):
        raise ConfigError(f"load={kind} is not served by backend {c['backend']['name']!r} (it runs static batches "
                          f"only{'; it serves ' + ', '.join(cls.load_kinds) if cls.load_kinds else ''}); use load=static or "
                          "another backend")


def check_results_dir(sweep: Path, job: str) -> None:
    """The results can be written: no file where a folder must be, write permission where the
    first missing folder would be made."""
    for p in (sweep.parent, sweep, sweep / job):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"results folder {p} is a file, not a folder; move it away or choose another "
                              "results_dir / sweep_name")
    existing = next(p for p in (sweep / job, sweep, *sweep.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"results_dir: cannot write under {existing} (no write permission); choose a "
                          "results_dir you can write to")


def engine_method(c: dict) -> tuple[dict, list[str]]:
    """The method config the engine is given, without the keys that are knobs of other methods
    only (set for a multi-method sweep; bench/methods.py: split_method_keys), and those keys."""
    ignored, _ = split_method_keys(c["method"])
    return {k: v for k, v in c["method"].items() if k not in ignored}, ignored


@dataclass
class JobSpec:
    """One job's settings, checked once: Hydra's config validated, the load normalized, the
    backend's support for the method and load, the results folder writable. check_job (the
    sweep's pre-check) and run_job both start from it."""
    cfg: DictConfig
    c: dict
    root: Path  # the sweep's folder
    method: dict  # the method config the engine is given (without other methods' knobs)
    ignored: list[str]  # those knobs

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> "JobSpec":
        validate(cfg)
        c = load.normalize(OmegaConf.to_container(cfg, resolve=True))
        check_backend_supports(c)
        root = Path(c["results_dir"]).expanduser().resolve() / c["sweep_name"]
        check_results_dir(root, job_name(c))
        method, ignored = engine_method(c)
        return cls(cfg, c, root, method, ignored)

    @property
    def dir(self) -> Path:
        return self.root / job_name(self.c)

    @property
    def settings(self) -> dict:
        """The backend's own settings (its config node without Hydra's keys)."""
        return {k: v for k, v in self.c["backend"].items() if k not in ("_target_", "name")}

    def prompts(self):
        c = self.c
        return load_prompts(c["workload"]["name"], c["num_prompts"], c["seed"], c.get("prompt_tokens"),
                            **{k: v for k, v in c["workload"].items() if k != "name"})


def check_job(cfg: DictConfig) -> list[str]:
    """Everything about one job that can be checked without loading a model (bench/sweeper.py runs
    this for every job of a multirun before the first runs): a ValueError (or FileNotFoundError)
    saying what is wrong and what is valid. Returns the method keys the job ignores (knobs of
    other methods)."""
    job = JobSpec.from_cfg(cfg)
    adapter = get_class(job.c["backend"]["_target_"])
    adapter.check_config(job.settings, job.c["model"], job.method, job.c["num_speculative_tokens"])
    check_rows(job.c, adapter, job.settings)
    check_context(job.c, adapter, job.settings)
    check_resources(job.c, adapter, job.settings, job.method)
    try:
        job.prompts()
    except WorkloadUnavailable:
        pass  # recorded as skipped when it runs
    return job.ignored


def job_work(cfg: DictConfig) -> tuple[int, int]:
    """The tokens a job will prefill (at a set input length; 0 otherwise, the workloads' own
    prompts being short) and decode, over both arms and every repeat: what the sweep's progress
    weighs jobs by."""
    c = load.normalize(OmegaConf.to_container(cfg, resolve=True))
    ld = c.get("load") or {"kind": "static"}
    requests = c["num_prompts"] if ld["kind"] == "static" else ld["num_requests"]
    arms = 2 if c["method"].get("speculative", True) or c.get("aa_control") else 1
    runs = requests * c["repeats"] * arms
    return runs * int(c.get("prompt_tokens") or 0), runs * int(c["max_new_tokens"])
