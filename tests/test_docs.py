"""Docs that cannot drift: the site builds strict, every figure a page quotes equals its data, the
reference pages are what the code declares, every `specsweep` command a page shows composes with
the real config (no key that does not exist), and the README stays a guide (<= 250 lines)."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bench import published
from bench.cli import CONF_DIR

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def bash_blocks(path: Path) -> list[tuple[str, str]]:
    """(the comment line right above it or "", the block's text) for every ```bash block."""
    text = path.read_text()
    return [(m.group(1) or "", m.group(2)) for m in
            re.finditer(r"(?:(<!--[^\n]*-->)\n)?```bash\n(.*?)```", text, re.S)]


def specsweep_commands(block: str) -> list[list[str]]:
    """Each `specsweep ...` command of a block, split into words (continuations joined, comments cut)."""
    text = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in text.splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words and words[0] == "specsweep":
                out.append(words[1:])
    return out


def documented_overrides() -> list[tuple[str, list[str]]]:
    out = []
    for page in PAGES:
        for _, block in bash_blocks(page):
            for words in specsweep_commands(block):
                overrides = [w for w in words if "=" in w and not w.startswith(("-", "hydra", "+hydra", "++hydra"))]
                # Hydra's range(start, stop) or range(stop) sweep: its first value stands for it
                overrides = [re.sub(r"=range\((-?\d+)(,[^)]*)?\)$", lambda m: "=" + (m.group(1) if m.group(2) else "0"), o)
                             for o in overrides]
                # a swept list: its first value stands for the rest (each is composed the same way)
                where = f"{page.relative_to(ROOT)}: specsweep {' '.join(words)}"
                # a swept list: each of its values composed, the other lists at their first value
                lists = {i: o.split("=", 1)[1].split(",") for i, o in enumerate(overrides)
                         if "," in o and "[" not in o}
                first = [o.split("=", 1)[0] + "=" + lists[i][0] if i in lists else o for i, o in enumerate(overrides)]
                out.append((where, first))
                for i, values in lists.items():
                    for v in values[1:]:
                        out.append((where, first[:i] + [overrides[i].split("=", 1)[0] + "=" + v] + first[i + 1:]))
    return out


def test_readme_is_a_guide_not_a_log():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/ (a page per task)"


def test_site_builds_in_strict_mode(tmp_path):
    r = subprocess.run(["mkdocs", "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                       capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": shutil.os.environ["PATH"]})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_every_quoted_figure_equals_its_data():
    r = subprocess.run([sys.executable, "-m", "bench.published", "fill", "--check", "README.md", "docs"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout + r.stderr) + "\nrun: python -m bench.published fill README.md docs"


def test_a_marker_fails_on_a_figure_the_data_does_not_have(tmp_path):
    with pytest.raises(published.MarkerError, match="no column 'speedupp'"):
        published.fill_text("<!-- figure 2026-12-06-aa-control speedupp where backend=native batch_size=1 -->"
                            "x<!-- /figure -->")
    with pytest.raises(published.MarkerError, match="known:"):
        published.fill_text("<!-- table no-such-run speedup --><!-- /table -->")


def test_a_recorded_measurement_keeps_the_columns_asked_for(tmp_path, monkeypatch):
    """record keeps the default columns, and a column named with --column besides them."""
    import json

    import pandas as pd

    monkeypatch.setattr(published, "MEASUREMENTS", tmp_path)  # the folders' page is rendered from there

    job = tmp_path / "sweep" / "native-ngram-chat-b1"
    job.mkdir(parents=True)
    (job / "summary.json").write_text(json.dumps({"job": job.name, "status": "ok", "backend": "native", "method": "ngram",
                                                  "workload": "chat", "batch_size": 1, "speedup": 1.2,
                                                  "verify_cost_ratio": 1.1, "cpu": "some CPU"}))
    (job / "config.yaml").write_text("method:\n  name: ngram\n  max_ngram: 5\nbackend:\n  threads: 2\n")
    for name, extra in (("plain", []), ("more", ["--column", "verify_cost_ratio", "--column", "method.max_ngram",
                                                  "--column", "method.min_ngram", "--column", "backend.threads"])):
        assert published.main(["record", str(tmp_path / "sweep"), "--out", str(tmp_path / name), "--title", "t",
                               "--command", "specsweep", *extra]) == 0
    assert "verify_cost_ratio" not in pd.read_csv(tmp_path / "plain" / "index.csv").columns
    more = pd.read_csv(tmp_path / "more" / "index.csv")
    assert more.verify_cost_ratio.tolist() == [1.1] and more["backend.threads"].tolist() == [2]
    assert more["method.max_ngram"].tolist() == [5] and more["method.min_ngram"].tolist() == [1]  # as set; its default


def test_a_changed_figure_is_caught_as_drift():
    page = ("<!-- figure 2026-12-06-aa-control speedup:.3f where backend=native batch_size=1 -->"
            "1.5<!-- /figure -->")
    assert published.fill_text(page) != page
    assert published.fill_text(published.fill_text(page)) == published.fill_text(page)


def test_reference_pages_are_what_the_code_declares(tmp_path):
    """Under another home and cache folder too: a page that printed this machine's paths would
    differ on the next one (the CLI reference once held the vLLM environment's full path)."""
    env = {**os.environ, "HOME": str(tmp_path), "SPECSWEEP_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "bench.reference", "--check"], cwd=ROOT, capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_setting_has_one_default():
    """conf/config.yaml sets only the sweep: a top-level key with a default there as well as in
    SweepConfig would be two defaults that can disagree."""
    import yaml

    from bench.config import SweepConfig

    root = yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())
    twice = set(root) & set(SweepConfig.__dataclass_fields__)
    assert not twice, f"declared in conf/config.yaml and in SweepConfig: {sorted(twice)}"
    for variant in (ROOT / "conf" / "backend").glob("*.yaml"):  # a server variant restates none of its base's settings
        extra = set(yaml.safe_load(variant.read_text())) - {"defaults", "_target_", "name"}
        assert not extra, f"{variant.name} sets {sorted(extra)}: its base node's dataclass declares them"
    # every adapter's default draft length is the sweep's (a test or notebook building one directly drafts the same k)
    import inspect

    from hydra.utils import get_class

    import backends
    from bench.backend import DEFAULT_DRAFT_LENGTH

    assert SweepConfig.num_speculative_tokens == DEFAULT_DRAFT_LENGTH
    for path in backends.CONFIGS:
        adapter = get_class(get_class(path)._target_)
        k = inspect.signature(adapter.__init__).parameters["num_speculative_tokens"].default
        assert k == DEFAULT_DRAFT_LENGTH, (adapter.__name__, k)


@pytest.mark.parametrize("where, overrides", documented_overrides(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_documented_command_names_real_keys(where, overrides):
    """Composed with the real config: a key that does not exist, a group option that does not, or a
    value of the wrong type for a typed setting fails here, as it would for the user."""
    from bench.config import unknown_key_problems

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    assert not unknown_key_problems(cfg), where


def test_documented_commands_were_found():
    found = documented_overrides()
    assert len(found) >= 20, found
    assert any("aa_control=true" in o for _, ov in found for o in ov)


def runnable_blocks() -> list[tuple[str, str, list[str]]]:
    """(where, block, size overrides) for every bash block a page marks `<!-- runnable: KEY=VALUE ... -->`."""
    out = []
    for page in PAGES:
        for marker, block in bash_blocks(page):
            m = re.match(r"<!-- runnable:?(.*?)-->", marker)
            if m:
                out.append((str(page.relative_to(ROOT)), block, m.group(1).split()))
    return out


def test_some_blocks_are_marked_runnable():
    assert len(runnable_blocks()) >= 1  # each costs CI minutes (engines start): the ones that cover most


@pytest.mark.full
@pytest.mark.parametrize("where, block, sizes", runnable_blocks(), ids=[w for w, _, _ in runnable_blocks()])
def test_a_runnable_block_runs_as_written_at_a_small_size(where, block, sizes, tmp_path):
    """The block's every specsweep command, run as a user would (the real CLI, engines, model), with
    the marker's size overrides in place of the block's own values for those keys and the results
    in a temporary folder: it must exit 0 with every job ok."""
    import pandas as pd

    replaced = {s.split("=", 1)[0] for s in sizes}
    for i, words in enumerate(specsweep_commands(block)):
        words = [w for w in words if w.split("=", 1)[0] not in replaced] + sizes
        r = subprocess.run(["specsweep", *words, f"results_dir={tmp_path}", f"sweep_name=run{i}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{where}: specsweep {' '.join(words)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        index = pd.read_csv(tmp_path / f"run{i}" / "index.csv")
        assert (index.status == "ok").all(), index[["job", "status", "error"]]
