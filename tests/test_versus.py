"""specsweep-versus: two methods' jobs on the same requests, head to head (bench.metrics.versus
on synthetic batches, the command on job folders written here in the runner's layout)."""
import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from bench.metrics import paired_speedup, versus
from bench.versus import main


def _batches(prompts, gain, rng):
    """One job's batches: each prompt's baseline seconds and how much it lends itself to
    speculation (any method's), a method `gain` faster on each, and its own run-to-run noise."""
    base, easy = prompts
    n = len(base)
    spec = base / (gain * easy * rng.normal(1.0, 0.03, n))
    return pd.DataFrame({"tokens_spec": 64, "wall_s_spec": spec, "tokens_base": 64,
                         "wall_s_base": base * rng.normal(1.0, 0.03, n)})


def test_a_method_ahead_on_every_request_is_seen_ahead_where_separate_intervals_overlap():
    rng = np.random.default_rng(5)
    prompts = (rng.lognormal(0.0, 1.0, 16) + 1.0, rng.lognormal(0.0, 0.4, 16))  # prompts that differ a lot
    a, b = _batches(prompts, 1.1, rng), _batches(prompts, 1.0, rng)
    sa = paired_speedup(a.tokens_spec, a.wall_s_spec, a.tokens_base, a.wall_s_base)
    sb = paired_speedup(b.tokens_spec, b.wall_s_spec, b.tokens_base, b.wall_s_base)
    assert sa["speedup_ci_low"] < sb["speedup_ci_high"]  # apart only at their point estimates
    got = versus(a, b)
    assert got["ratio"] == pytest.approx(sa["speedup"] / sb["speedup"])
    assert 1.0 < got["ratio_ci_low"] < got["ratio"] < got["ratio_ci_high"] < 1.25
    null = versus(a, a)  # the null control: a job against itself reads 1.0, its interval 1.0 too
    assert null["ratio"] == 1.0 and null["ratio_ci_low"] == pytest.approx(1.0) == null["ratio_ci_high"]
    with pytest.raises(ValueError, match="16 batches of A against 15 of B"):
        versus(a, b.iloc[1:])


def _job(folder, method, batch_size=1, gain=1.0, seed=0):
    """A completed job's two files as the runner writes them: config.yaml and requests.parquet."""
    folder.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"model": {"name": "tiny"}, "workload": {"name": "chat"}, "method": {"name": method},
                                     "batch_size": batch_size, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                     "max_new_tokens": 8, "num_prompts": 4, "seed": seed}), folder / "config.yaml")
    rows = []
    for rep in range(2):
        for i in range(4):
            for run, t in (("baseline", 1.0 + i), ("spec", (1.0 + i) / gain)):
                rows.append({"run": run, "repeat": rep, "batch": i, "request_id": f"chat-{i}", "category": "chat",
                             "output_token_ids": np.arange(8), "e2e_s": t * (1 + 0.01 * rep)})
    pd.DataFrame(rows).to_parquet(folder / "requests.parquet")
    return folder


def test_the_command_compares_two_jobs_and_refuses_jobs_of_other_requests(tmp_path, capsys):
    a, b = _job(tmp_path / "a", "ngram", gain=1.5), _job(tmp_path / "b", "draft_model", gain=1.2)
    assert main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ngram (a) against draft_model (b) on the same 8 batches: 1.250x [")
    assert "their paired speedups over those batches: 1.500 and 1.200" in out
    c = _job(tmp_path / "c", "draft_model", batch_size=2)
    assert main([str(a), str(c)]) == 2
    assert "did not run the same requests (batch_size: 1 against 2)" in capsys.readouterr().err
    assert main([str(a), str(tmp_path / "missing")]) == 2
    assert "is not a completed job folder" in capsys.readouterr().err
