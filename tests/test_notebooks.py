"""The analysis notebook runs headless (nbclient) on a small sweep made here."""
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.full
def test_analysis_notebook_executes(tmp_path, tiny_llama):
    r = subprocess.run([sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", "sweep_name=nb", "model=local",
                        f"model.path={tiny_llama}", "method=ngram,draft_model", "++method.draft_layers=2", "workload=chat",
                        "batch_size=1,2", "num_prompts=2", "max_new_tokens=8", "repeats=2", "report=false"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    nb = nbformat.read(ROOT / "notebooks" / "analysis.ipynb", as_version=4)
    assert all(c.get("outputs", []) == [] for c in nb.cells if c.cell_type == "code")  # no outputs committed
    os.environ["SPECSWEEP_RESULTS"] = str(tmp_path / "nb")
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        del os.environ["SPECSWEEP_RESULTS"]
    text = "\n".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for c in nb.cells
                     if c.cell_type == "code" for o in c.outputs)
    assert "4 jobs" in text and "ngram" in text
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_oracle_notebook_executes(tmp_path):
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    f = tmp_path / "combined_toy.jsonl"
    def acc(high):  # random acceptance lengths, none beyond the tokens left (load_traces checks it)
        return [min(int(v), 30 - j) for j, v in enumerate(rng.integers(1, high, 30))]

    f.write_text("".join(json.dumps({"id": str(i), "prompt_token_ids": list(range(20)), "generated_token_ids": list(range(30)),
                                     "acc_ngram": {"acc_len": acc(5)}, "acc_eagle": {"acc_len": acc(4)}}) + "\n"
                         for i in range(12)))
    nb = nbformat.read(ROOT / "notebooks" / "oracle.ipynb", as_version=4)
    assert all(c.get("outputs", []) == [] for c in nb.cells if c.cell_type == "code")
    os.environ["SPECSWEEP_TRACES"] = str(tmp_path)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        del os.environ["SPECSWEEP_TRACES"]
    text = "\n".join(str(o.get("data", {}).get("text/plain", "")) + o.get("text", "") for c in nb.cells
                     if c.cell_type == "code" for o in c.outputs)
    assert "combined:ngram+eagle" in text and "share_of_tokens" in text
