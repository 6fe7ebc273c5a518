"""The report's HTML page: one self-contained file with the summary's tables (sortable), the
plots embedded and a drill-down per job; opened in a real headless Chromium (Debian's
chromium-headless-shell), it loads with no console error and renders a page that is not blank."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser")


@pytest.fixture(scope="module")
def report(tmp_path_factory, tiny_llama):
    """A real sweep on a random-weight Llama built here: n-gram at batch 1 and 2, and an A/A control."""
    from hydra import compose, initialize_config_dir

    from bench.cli import CONF_DIR
    from bench.report import write_report
    from bench.runner import run_job

    root = tmp_path_factory.mktemp("html")
    for overrides in (["method=ngram", "batch_size=1"], ["method=ngram", "batch_size=2"],
                      ["method=autoregressive", "aa_control=true", "batch_size=2"]):
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose("config", overrides=[f"results_dir={root}", "sweep_name=s", "model=local",
                                               f"model.path={tiny_llama}", "workload=code_edit", "num_prompts=4",
                                               "max_new_tokens=8", "repeats=2", "warmup=false", "report=false",
                                               *overrides])
        assert run_job(cfg)["status"] == "ok"
    return write_report(root / "s") / "index.html"


def test_the_page_holds_the_summary_the_plots_and_every_job(report):
    page = report.read_text()
    summary = (report.parent / "summary.md").read_text()
    assert page.count("data:image/png;base64,") == len(re.findall(r"!\[[^]]*\]\([^)]+\.png\)", summary)) >= 2
    assert "<table>" in page and "## " not in page  # the markdown rendered, not pasted
    assert page.count("<details id=") == 3 and "Controls (A/A)" in page
    assert "pairs behind the interval" in page and "Acceptance per draft position" in page
    assert "src=\"http" not in page and "<link" not in page  # nothing fetched: it opens offline
    # the spread of acceptance over each job's requests, beside its overall alpha (two n-gram jobs)
    section = summary.split("## Acceptance per request", 1)[1].split("\n## ", 1)[0]
    assert section.count("| native | ngram | code_edit |") == 2 and "request_acceptance_p90" in section


def _browser():
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


def _open(browser, page, shot):
    """Load a page in headless Chromium: its console lines (errors among them) and the screenshot."""
    r = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                        "--hide-scrollbars", "--window-size=1200,1600", f"--screenshot={shot}", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    console = [line for line in r.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    return r.returncode, console


@pytest.mark.full
def test_the_page_opens_in_headless_chromium_without_a_console_error(report, tmp_path):
    browser = _browser()
    assert browser, ("no headless Chromium: the test command installs Debian's chromium-headless-shell "
                     "(apt-get install chromium-headless-shell)")
    # the check itself can fail: a page with a script error is caught
    broken = tmp_path / "broken.html"
    broken.write_text("<html><body><p>x</p><script>undefinedFunction();</script></body></html>")
    rc, console = _open(browser, broken, tmp_path / "broken.png")
    assert any("undefinedFunction" in line for line in console), console
    rc, console = _open(browser, report, tmp_path / "shot.png")
    assert rc == 0 and not [line for line in console if "Uncaught" in line or ":ERROR:" in line], console
    import matplotlib.image

    pixels = matplotlib.image.imread(tmp_path / "shot.png")
    assert pixels.shape[0] >= 1000 and pixels[..., :3].std() > 0.05  # text, tables and plots, not a blank page
