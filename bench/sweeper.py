"""Every job of a multirun composed and checked before the first one runs (called by the sweep
callback in bench/cli.py as the multirun starts). Checked per job, without loading a model: the
sweep values (bench.config.validate), the method's keys against its schema (its
typed node, bench/method_settings.py: a key no method knows is an error; a knob of another method, set for a
multi-method sweep, is ignored by the job and listed in its row), that the backend runs the
method, the backend's own settings and files (Backend.check_config), that the prompts load and
the results folder can be written. Any failure lists every bad job with its overrides and what
is valid, and nothing runs (exit status 2). The jobs are the ones Hydra's basic sweeper will
launch, expanded the same way; launchers (joblib, submitit, Ray) are untouched.
"""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("specsweep")


def sweep_jobs(config) -> list[list[str]]:
    """The override list of every job the basic sweeper will launch for this multirun config.
    Hydra has no public API for this expansion: BasicSweeper.split_arguments is private, so
    hydra-core is pinned below 1.4 (pyproject.toml) and a test checks the expansion."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    loader = GlobalHydra.instance().config_loader()
    # unresolved: an override such as num_prompts=${batch_size} is an interpolation each job
    # resolves in its own config, as the sweeper hands it on (reading it here would resolve it
    # against the multirun's config, its defaults)
    def raw(node):
        return OmegaConf.to_container(node, resolve=False) if node is not None else None

    params = [f"{k}={v}" for k, v in (raw(config.hydra.sweeper.get("params")) or {}).items()]
    params += raw(config.hydra.overrides.task)
    overrides = OverridesParser.create(config_loader=loader).parse_overrides(params)
    return [list(job) for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def check_sweep(config) -> list[tuple[int, int]] | None:
    """Check every job of the multirun (exit 2 on bad input); per job, in launch order, the tokens
    it will prefill and decode (bench.jobspec.job_work), or None where another sweeper expands
    them."""
    from hydra.core.global_hydra import GlobalHydra

    from .methods import method_schemas
    from .jobspec import check_job, job_work
    from .pace import estimate, pace_key

    if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        log.info("sweeper %s: its jobs are checked one by one as they start", config.hydra.sweeper.get("_target_"))
        return None
    loader = GlobalHydra.instance().config_loader()
    jobs = sweep_jobs(config)
    problems, work, keys = [], [], []
    used, ignored = set(), {}  # method keys some job's engine reads; keys ignored -> the methods ignoring them
    from omegaconf import open_dict

    from hydra.errors import ConfigCompositionException

    for job in jobs:
        contender = [o for o in job if o.startswith("+contender=")]
        method = [o for o in job if o.startswith("method=")]
        if contender and method:  # Hydra would quietly let the swept method win over the contender's
            problems.append(f"  job {' '.join(job)}: {method[0]} replaces the method of {contender[0]}; drop the "
                            "default sweep's lists with axes=none, or the method (docs/guides/sweeps.md)")
            continue
        try:
            cfg = loader.load_sweep_config(config, job)
        except ConfigCompositionException as e:  # a job whose overrides do not compose, named with the cause
            problems.append(f"  job {' '.join(job)}: {' '.join(str(e.__cause__ or e).split())}")
            continue
        with open_dict(cfg):
            del cfg["hydra"]  # the job's own config, as the launcher hands it to the job
        try:
            skipped = check_job(cfg)
        except (ValueError, FileNotFoundError) as e:  # ConfigError, WorkloadError and the adapters' own
            problems.append(f"  job {' '.join(job) or '(defaults)'}: {e}")
            continue
        work.append(job_work(cfg))
        keys.append(pace_key(cfg))
        used |= {str(k) for k in cfg.method if k not in skipped}
        for k in skipped:
            ignored.setdefault(k, set()).add(str(cfg.method.name))
    if problems:
        print(f"specsweep: {len(problems)} of {len(jobs)} jobs have bad input; nothing was run:\n" + "\n".join(problems),
              file=sys.stderr)
        raise SystemExit(2)
    for k in sorted(set(ignored) - used):  # a knob no job of this sweep runs a method for
        owners = [m for m, keys in method_schemas().items() if k in keys]
        log.warning("method.%s is a knob of %s, which this sweep does not run: every job ignores it (%s); each row "
                    "lists it in method_ignored_keys", k, ", ".join(owners), ", ".join(sorted(ignored[k])))
    prompt, decode = (sum(w[i] for w in work) for i in (0, 1))
    log.info("checked %d jobs before running any: %s tokens to decode%s", len(jobs), f"{decode:,}",
             f" and {prompt:,} prompt tokens to prefill" if prompt else "")
    log.info("%s", estimate(keys, work)[1])
    return work
