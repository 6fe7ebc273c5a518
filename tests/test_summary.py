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
