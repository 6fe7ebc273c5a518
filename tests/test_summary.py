"""bench/summary.py: every column of a job's row declared once, the views drawn from it, and the
column reference generated from it."""
import logging
import re
from dataclasses import fields
from pathlib import Path

import pytest

from bench import summary
from bench.summary import JobSummary, checked_row

ROOT = Path(__file__).resolve().parent.parent
KEY = dict(backend="native", model="m", method="ngram", workload="chat", batch_size=1, temperature=0.0, top_p=1.0, top_k=0,
           num_speculative_tokens=3, max_new_tokens=8, num_prompts=1, seed=0, config_hash="abc")


def test_docs_columns_md_is_generated_from_the_record():
    assert (ROOT / "docs" / "columns.md").read_text() == summary.markdown(), \
        "docs/columns.md is stale: run python -m bench.summary > docs/columns.md"


def test_every_section_a_column_names_is_a_heading_of_docs_metrics_md():
    headings = set(re.findall(r"^## (.+)$", (ROOT / "docs" / "metrics.md").read_text(), re.M))
    named = {f.metadata["section"] for f in fields(JobSummary) if f.metadata.get("section")}
    assert named and named <= headings, named - headings


def test_a_row_comes_out_in_declared_order_without_the_columns_it_did_not_write(monkeypatch):
    row = checked_row({**KEY, "speedup": 1.5, "status": "ok", "error": None, "job": "j"})
    assert list(row) == [n for n in JobSummary.names() if n in row]  # declared order: identity first
    assert row["error"] is None and "tpot_speedup" not in row  # None is kept; a column not written is left out


def test_an_undeclared_column_fails_under_strict_and_is_kept_with_a_warning_otherwise(monkeypatch, caplog):
    monkeypatch.setenv("SPECSWEEP_STRICT_COLUMNS", "1")
    with pytest.raises(ValueError, match="column\\(s\\) speedup_x not declared in bench/summary.py JobSummary"):
        checked_row({**KEY, "speedup_x": 2.0})
    monkeypatch.delenv("SPECSWEEP_STRICT_COLUMNS")
    with caplog.at_level(logging.WARNING, logger="specsweep"):
        row = checked_row({**KEY, "speedup_x": 2.0})
    assert row["speedup_x"] == 2.0 and list(row)[-1] == "speedup_x"  # nothing measured is dropped
    assert "speedup_x not declared" in caplog.text


def test_the_views_are_declared_columns_and_the_tools_read_them():
    from bench import cli, gate, report

    assert cli.TABLE_COLUMNS is summary.TABLE_COLUMNS and report.REPORT_COLUMNS is summary.REPORT_COLUMNS
    assert gate.RECORDED is summary.GATE_RECORDED and set(gate.NUMERIC) <= set(gate.RECORDED)
    with pytest.raises(ValueError, match="not declared"):
        JobSummary.from_row({**KEY, "no_such_column": 1})


def _default_sweep_rows(n_backends: int = 1):
    import itertools

    import pandas as pd

    rows = []
    for backend, wl, method, b in itertools.product(["native", "llamacpp_server"][:n_backends], ["code_edit", "chat"],
                                                     ["ngram", "draft_model"], [1, 4]):
        rows.append(dict(backend=backend, method=method, workload=wl, batch_size=b, temperature=0.0, status="ok",
                         speedup=2.413, speedup_ci_low=2.261, speedup_ci_high=12.56, acceptance_rate=0.853,
                         mean_acceptance_length=4.39, tokens_per_forward=4.1, verify_fraction=0.97,
                         draft_fraction=0.005, baseline_roofline_share=0.6, lossless="true", job=f"{backend}-{method}"))
    return pd.DataFrame(rows)


@pytest.mark.parametrize("n_backends", [1, 2])
def test_the_cli_table_fits_120_columns_one_line_a_row(capsys, monkeypatch, n_backends):
    from bench.cli import print_table

    monkeypatch.delenv("COLUMNS", raising=False)
    df = _default_sweep_rows(n_backends)
    print_table(df, title="specsweep: results/default")
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 120, "\n".join(lines)
    body = [line for line in lines if "ngram" in line or "draft_model" in line]
    assert len(body) == len(df), "a row wrapped onto a second line:\n" + "\n".join(lines)
    head = next(line for line in lines if "speedup [95%]" in line)
    for short in ("alpha", "tau", "verify", "draft", "roofline"):
        assert short in head
    assert any(line.startswith("alpha: acceptance rate") for line in lines)  # the legend
    if n_backends == 1:  # one engine, one temperature: said once under the table, not in every row
        assert any("engine native" in line for line in lines) and "engine" not in head


def test_the_cli_table_is_wider_on_request(capsys, monkeypatch):
    from bench.cli import print_table

    monkeypatch.setenv("COLUMNS", "200")
    print_table(_default_sweep_rows(2), title="x" * 190)
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) > 120


def test_the_cli_table_of_load_points_fits_120_columns(capsys, monkeypatch):
    """Under load the level replaces batch, empty columns (a deployment's time split) are left out,
    and a column of one value goes to the caption: every row on one line within 120 columns."""
    import pandas as pd

    from bench.cli import print_table

    monkeypatch.delenv("COLUMNS", raising=False)
    rows = [dict(backend=b, method="autoregressive", workload="code_edit", batch_size=lvl, temperature=0.0, status="ok",
                 speedup=1.013, speedup_ci_low=0.97, speedup_ci_high=1.05, acceptance_rate=float("nan"),
                 mean_acceptance_length=float("nan"), verify_fraction=float("nan"), draft_fraction=float("nan"),
                 baseline_roofline_share=0.51, lossless="true", load_kind="concurrency", load_level=lvl,
                 load_label=f"c{lvl}", tpot_speedup=1.01, goodput_rps=1.33, baseline_goodput_rps=1.34, aa_control=True,
                 aa_verdict="excludes 1.0: speedup 1.026 [1.002, 1.053]", job=f"{b}-c{lvl}")
            for b in ("llamacpp_server", "openai_endpoint") for lvl in (1, 4, 8)]
    print_table(pd.DataFrame(rows), title="specsweep: results/aa")
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 120, "\n".join(lines)
    table = [line for line in lines if " c1 " in line or " c4 " in line or " c8 " in line]
    assert len(table) == 6 and all("EXCLUDES" in line for line in table) and "…" not in "".join(table)
    assert not any("verify" in line and "draft" in line and "alpha" in line for line in lines[:4])  # empty: left out
    assert any("excludes 1.0: speedup 1.026" in line for line in lines)  # the verdicts in full, below


def test_the_cli_table_shows_the_input_length_when_a_sweep_sets_it(capsys, monkeypatch):
    from bench.cli import print_table

    monkeypatch.delenv("COLUMNS", raising=False)
    df = _default_sweep_rows(1)
    df["prompt_tokens"] = [8192, 512] * (len(df) // 2)
    print_table(df, title="specsweep: results/long")
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 120
    head = next(line for line in lines if "speedup [95%]" in line)
    assert " in " in f" {head} "
    print_table(_default_sweep_rows(1), title="no lengths")
    assert " in " not in next(line for line in capsys.readouterr().out.splitlines() if "speedup [95%]" in line)
