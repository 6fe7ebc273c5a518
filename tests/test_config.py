"""Config errors: caught before any model loads, naming the bad value and what is valid."""
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from bench.cli import CONF_DIR
from bench.config import ConfigError, validate
from bench.jobspec import check_backend_supports


def _cfg(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_default_config_is_valid_and_has_the_contract_keys():
    cfg = _cfg()
    validate(cfg)
    for key in ("backend", "model", "method", "workload", "batch_size", "temperature", "top_p", "num_speculative_tokens",
                "max_new_tokens", "num_prompts", "repeats", "seed", "results_dir", "sweep_name", "force"):
        assert key in cfg, key


def test_unknown_method_lists_valid_names():
    with pytest.raises(MissingConfigException) as e:
        _cfg("method=medusa9")
    msg = str(e.value)
    assert "medusa9" in msg and "ngram" in msg and "draft_model" in msg


@pytest.mark.parametrize("override, expected", [
    ("batch_size=-1", "batch_size=-1: use 1 or more"),
    ("temperature=-0.5", "temperature=-0.5: use 0"),
    ("top_p=1.5", "top_p=1.5: use a value in (0, 1]"),
    ("num_speculative_tokens=0", "num_speculative_tokens=0: a speculative method (ngram) needs 1 or more"),
    ("repeats=0", "repeats=0: use 1 or more"),
    ("baseline=sometimes", "baseline='sometimes': use shared or paired"),
])
def test_invalid_values_say_what_is_allowed(override, expected):
    with pytest.raises(ConfigError) as e:
        validate(_cfg(override))
    assert expected in str(e.value)


def test_k_zero_is_fine_for_the_baseline():
    validate(_cfg("method=autoregressive", "num_speculative_tokens=0"))


def test_wrong_type_is_rejected_by_the_schema():
    with pytest.raises(Exception, match="batch_size"):
        _cfg("batch_size=four")


def test_method_the_backend_cannot_run_is_a_config_error():
    c = OmegaConf.to_container(_cfg(), resolve=True)
    c["method"] = {"name": "ngram_mod", "speculative": True}  # llama-server's drafter only
    with pytest.raises(ConfigError, match="'ngram_mod' is not supported by backend 'native'; it supports autoregressive, ngram"):
        check_backend_supports(c)


def test_cli_rejects_bad_value_before_loading_anything(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", "batch_size=0", "method=ngram",
                        "workload=chat"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "batch_size=0: use 1 or more" in r.stdout + r.stderr
    assert not list(tmp_path.rglob("summary.json"))


def test_cli_unknown_workload_lists_options(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", "workload=poetry"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "poetry" in out and "code_edit" in out and "summarization" in out


def test_every_method_declares_its_drafter_and_the_harness_reads_it_not_the_name(tmp_path):
    from bench.costmodel import LLAMA31_8B_H100
    from bench.methods import DRAFTER_KINDS, drafter_kind, known_methods

    kinds = known_methods()
    assert set(kinds.values()) <= set(DRAFTER_KINDS) and kinds["autoregressive"] == "none"
    # suffix decoding runs no model: a lookup, priced as one (it once counted as neural by its name)
    assert drafter_kind("suffix") == "lookup" and drafter_kind("eagle3") == "head"
    assert LLAMA31_8B_H100.draft("suffix") is LLAMA31_8B_H100.default_ngram
    assert LLAMA31_8B_H100.draft("p_eagle") is LLAMA31_8B_H100.default_neural
    # a config's own declaration wins over its name
    assert drafter_kind({"name": "ngram", "drafter": "model"}) == "model"
    with pytest.raises(ValueError, match=r"'medusa' is not one of specsweep's methods .*--drafter-kind medusa=KIND"):
        drafter_kind("medusa")
    cfg = _cfg("method.drafter=neural")
    with pytest.raises(ConfigError, match=r"method.drafter='neural' \(method ngram\).*none, lookup, model, head"):
        validate(cfg)


def test_a_methods_typed_node_is_its_schema(tmp_path):
    import dataclasses

    import bench.methods as m
    from bench.method_settings import METHODS

    for name, keys in m.method_schemas().items():
        assert keys == [f.name for f in dataclasses.fields(METHODS[name])]
    with pytest.raises(ConfigError, match=r"method.min_ngramm is not a knob of method ngram .*did you mean min_ngram\?"
                                          r".*valid for ngram: name, speculative, drafter, min_ngram, max_ngram"):
        validate(_cfg("method=ngram", "++method.min_ngramm=2"))
    validate(_cfg("method=ngram", "++method.draft_layers=1"))  # draft_model's knob: not an error for ngram
    assert m.split_method_keys({"name": "ngram", "draft_layers": 1, "alpha": 2}) == (["draft_layers"], ["alpha"])
    # a mixed drafter drafts with other methods' drafters: their knobs are its own
    assert m.split_method_keys({"name": "combined", "drafter": "mixed", "skip_layers": [1], "alpha": 2}) == ([], ["alpha"])
    with pytest.raises(ConfigError, match=r"method.max_ngramm is not a knob of method adaptive .*valid for adaptive: "
                                          r"name, .*policy.*, and the knobs of the methods it drafts with"):
        validate(_cfg("method=adaptive", "++method.max_ngramm=2"))
    # a knob's type is the node's: refused as the sweep is composed, naming the key
    with pytest.raises(Exception, match=r"min_ngram"):
        _cfg("method=ngram", "method.min_ngram=three")
    # a method that is not specsweep's (a user's own config file) has no schema to check against
    assert m.split_method_keys({"name": "toy", "alpha": 2}) == ([], [])


def test_no_method_default_is_written_twice():
    """Every knob's default is declared once: a knob two methods share is one mixin field (the same
    class attribute), never two fields that could drift apart."""
    import dataclasses

    from bench.method_settings import METHODS, Method

    declared: dict[tuple[str, str], type] = {}
    for node in METHODS.values():
        for f in dataclasses.fields(node):
            if f.name in ("name", "speculative", "drafter"):
                continue
            owner = next(c for c in node.__mro__ if f.name in c.__dict__.get("__annotations__", {}))
            declared.setdefault((f.name, owner.__name__), owner)
    by_name: dict[str, list[str]] = {}
    for (name, owner), _ in declared.items():
        by_name.setdefault(name, []).append(owner)
    # the same knob name declared in two classes is a second default, unless they are two engines' own
    # settings that merely share a name: llama-server's --spec-ngram-min-hits and llama-cpp-python's
    # max_ngram_size (default 2) are not specsweep's lookup's min_hits and max_ngram (default 3)
    twice = {n: sorted(o) for n, o in by_name.items() if len(o) > 1}
    assert twice == {"max_ngram": ["NgramKnobs", "PromptLookupLib"], "min_hits": ["LlamaMapKnobs", "NgramKnobs"]}, twice
    assert Method().speculative is True and all(n == cls().name for n, cls in METHODS.items())


def _adapter_configs():
    from hydra.utils import get_class

    import backends

    return [get_class(path) for path in backends.CONFIGS]


@pytest.mark.parametrize("variant", ["native", "llamacpp", "llamacpp_server", "vllm", "vllm_server", "sglang",
                                     "sglang_server", "openai_endpoint", "trtllm_endpoint"])
def test_every_backend_is_a_typed_node_whose_defaults_are_its_dataclass(variant):
    """backend=NAME composes the adapter's BackendConfig (its defaults written there once), a server
    variant derives the offline node's settings, and the adapter named by _target_ checks its
    settings against that same dataclass."""
    from dataclasses import fields

    from hydra.utils import get_class

    node = _cfg(f"backend={variant}").backend
    target = get_class(node._target_)
    assert OmegaConf.get_type(node) is target.config_cls and node.name == variant == target.name
    for f in fields(target.config_cls):
        if f.name not in ("_target_", "name"):
            assert node[f.name] == f.default, f.name


def test_the_registered_backends_are_the_adapters_list_and_each_adapter_takes_no_setting_by_name():
    """No adapter's __init__ lists a setting again (defaults once, in the dataclass) or swallows
    one: its settings are **settings, checked by checked_settings."""
    import inspect

    from hydra.core.config_store import ConfigStore
    from hydra.utils import get_class

    stored = {name.removesuffix(".yaml") for name in ConfigStore.instance().list("backend")}
    configs = _adapter_configs()
    assert stored == {c.name for c in configs}
    for c in configs:
        params = list(inspect.signature(get_class(c._target_).__init__).parameters)
        assert params == ["self", "model", "method", "num_speculative_tokens", "settings"], (c.name, params)


@pytest.mark.parametrize("override, expected", [("backend.threads=two", "backend.threads"),
                                                ("backend.trace=maybe", "backend.trace"),
                                                ("backend=vllm_server", None)])
def test_a_backend_value_of_the_wrong_type_is_refused_as_the_sweep_is_composed(override, expected):
    if expected is None:  # a derived variant is typed too
        with pytest.raises(Exception, match="backend.max_num_seqs"):
            _cfg(override, "backend.max_num_seqs=many")
        return
    with pytest.raises(Exception, match=expected):
        _cfg(override)


def test_an_adapter_refuses_an_unknown_setting_before_loading_a_model(tmp_path):
    """Constructed directly (a notebook), an adapter checks its keyword settings the same way: the
    model path does not exist, and the typo is what the error names."""
    from backends.native import NativeBackend
    from backends.llamacpp_server import LlamaServerBackend

    with pytest.raises(ValueError, match="backend.dtpye is not a setting of backend native; valid: dtype, device"):
        NativeBackend({"path": str(tmp_path / "absent")}, {"name": "ngram"}, 3, dtpye="bfloat16")
    with pytest.raises(ValueError, match="backend.ctx_per_slot=8 is not valid; use 64 or more"):
        LlamaServerBackend.check_config({"ctx_per_slot": 8}, {"path": "gemma3-270m"}, {"name": "ngram"}, 3)


@pytest.mark.parametrize("override, expected", [("backend.threads=two", "full_key: backend.threads"),
                                                ("workload=poetry", "poetry")])
def test_what_hydra_refuses_on_the_command_line_is_exit_2_bad_input(tmp_path, override, expected):
    r = subprocess.run([sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", override],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert expected in r.stderr and not list(tmp_path.rglob("summary.json"))


@pytest.mark.parametrize("overrides, expected, raised", [
    (["backend=vllm_server", "method=ngram", "load=concurrency", "load.level=16", "load.num_requests=16"],
     r"load.level=16 runs 16 requests at once; backend.max_num_seqs=8 holds fewer: raise it \(backend.max_num_seqs=16\)",
     "backend.max_num_seqs=16"),
    (["backend=llamacpp", "method=ngram", "batch_size=4", "backend.max_rows=2"],
     r"batch_size=4 runs 4 requests at once; backend.max_rows=2 holds fewer", "backend.max_rows=4"),
])
def test_more_rows_at_once_than_the_engine_holds_is_refused_before_any_job(tmp_path, overrides, expected, raised):
    """An adapter whose config caps the rows it runs at once (rows_setting: vLLM's max_num_seqs,
    llama.cpp's max_rows): a batch or load level above it stops the sweep's pre-check, not the
    job after its engine started."""
    import re

    from bench.jobspec import check_job

    cfg = _cfg(*overrides, f"results_dir={tmp_path}")
    with pytest.raises(ValueError) as e:
        check_job(cfg)
    assert re.search(expected, str(e.value)), str(e.value)
    check_job(_cfg(*overrides, raised, f"results_dir={tmp_path}"))  # with the cap raised as it says, it passes


def test_the_pre_check_expands_a_sweep_as_hydras_basic_sweeper_does():
    """bench/sweeper.py expands the multirun with Hydra's BasicSweeper.split_arguments, a private
    API (hydra._internal) pinned in pyproject (hydra-core < 1.4): this fails first if a Hydra
    release changes how a sweep expands. The default sweep's lists, one replaced from the command
    line by a single value, and a fixed key on every job."""
    from bench.sweeper import sweep_jobs

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        jobs = sweep_jobs(compose("config", overrides=["workload=chat", "repeats=3"], return_hydra_config=True))
        default = sweep_jobs(compose("config", return_hydra_config=True))
    assert sorted(map(tuple, jobs)) == sorted((f"method={m}", "workload=chat", f"batch_size={b}", "repeats=3")
                                             for m in ("ngram", "draft_model") for b in (1, 4))
    assert len(default) == 8 and {j[1] for j in default} == {"workload=code_edit", "workload=chat"}


def test_contenders_keep_their_own_method_knobs_and_draft_length_in_one_sweep(tmp_path):
    """+preset=combination sweeps conf/contender (each a method with its own knobs and k) with
    the default axes dropped: three jobs, each composed with its contender's method, k and knobs;
    from the command line axes=none does the same, and without it a swept method would win."""
    from hydra.core.global_hydra import GlobalHydra

    from bench.sweeper import sweep_jobs

    def composed(*overrides):
        multirun = compose("config", overrides=list(overrides), return_hydra_config=True)
        loader = GlobalHydra.instance().config_loader()
        return [loader.load_sweep_config(multirun, j) for j in sweep_jobs(multirun)]

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        preset = composed("+preset=combination", f"results_dir={tmp_path}")
        by_hand = composed("axes=none", "+contender=int4_self_draft", "workload=chat")
        with pytest.raises(Exception, match="bits"):  # the default axes' method=ngram,draft_model overrides it
            composed("+contender=int4_self_draft")
    got = {(c.method.name, c.num_speculative_tokens, c.method.get("bits"), c.workload.name, c.batch_size) for c in preset}
    assert got == {("ngram", 4, None, "math", 1), ("quantized_draft", 2, 4, "math", 1), ("adaptive", 8, 4, "math", 1)}
    rule = next(c for c in preset if c.method.name == "adaptive")
    assert rule.method.policy.startswith("conf:ngram+quantized_draft") and rule.method.draft_vocab == 16384
    assert [(c.method.name, c.num_speculative_tokens, c.method.bits, c.workload.name) for c in by_hand] == [
        ("quantized_draft", 2, 4, "chat")]
    r = subprocess.run([sys.executable, "-m", "bench.cli", "-m", "+contender=ngram", f"results_dir={tmp_path}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "method=draft_model replaces the method of +contender=ngram" in r.stderr
    assert "axes=none" in r.stderr and not list(tmp_path.glob("*/*/summary.json"))
    from omegaconf import open_dict

    from bench.jobspec import check_job

    for c in preset:  # each job passes the checks a sweep runs before any model loads
        with open_dict(c):
            del c["hydra"]
        check_job(c)


def test_an_interpolated_override_reaches_each_job_unresolved():
    """num_prompts=${batch_size}: each job resolves it in its own config (one batch a job at
    every batch size), as Hydra's sweeper hands it on; the pre-check must not resolve it first
    against the multirun's defaults (it did: batch 4 with num_prompts=1 was refused)."""
    from bench.sweeper import sweep_jobs

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        from hydra.core.global_hydra import GlobalHydra

        multirun = compose("config", overrides=["workload=chat", "num_prompts=${batch_size}"], return_hydra_config=True)
        jobs = sweep_jobs(multirun)  # the default sweep: batch 1 and 4
        loader = GlobalHydra.instance().config_loader()
        got = sorted((int(c.batch_size), int(c.num_prompts)) for c in (loader.load_sweep_config(multirun, j) for j in jobs))
    assert got == [(1, 1), (1, 1), (4, 4), (4, 4)]
