"""Config errors: caught before any model loads, naming the bad value and what is valid."""
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from bench.cli import CONF_DIR
from bench.config import ConfigError, validate
from bench.runner import check_backend_supports


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
    with pytest.raises(ValueError, match=r"'medusa' has no conf/method/medusa.yaml .*--drafter-kind medusa=KIND"):
        drafter_kind("medusa")
    cfg = _cfg("method.drafter=neural")
    with pytest.raises(ConfigError, match=r"method.drafter='neural' \(method ngram\).*none, lookup, model, head"):
        validate(cfg)


def test_a_methods_yaml_is_its_schema_read_from_the_files(tmp_path, monkeypatch):
    import shutil

    import bench.methods as m

    for name, keys in m.method_schemas().items():
        assert keys == list(OmegaConf.load(m.METHOD_DIR / f"{name}.yaml"))
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
    # a method added as a file is known by its file alone
    shutil.copy(m.METHOD_DIR / "ngram.yaml", tmp_path / "ngram.yaml")
    (tmp_path / "toy.yaml").write_text("name: toy\nspeculative: true\ndrafter: lookup\nalpha: 0.5\n")
    monkeypatch.setattr(m, "METHOD_DIR", tmp_path)
    m._method_configs.cache_clear()
    try:
        assert m.method_schemas()["toy"] == ["name", "speculative", "drafter", "alpha"]
        assert m.split_method_keys({"name": "ngram", "alpha": 2}) == (["alpha"], [])
    finally:
        monkeypatch.undo()
        m._method_configs.cache_clear()
