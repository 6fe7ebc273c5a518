"""The fast-path probe (backends/cpu_probe.py): a path tried in a child process, a crash there a
cached verdict rather than a dead test run. The children here really die by the signals named
(os.kill on themselves): that is the crash being simulated, not the engines."""
import json
import sys

import pytest

from backends.cpu_probe import Inconclusive, cpu_identity, decide, describe_exit, probe, run_child

SEGFAULT = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
ILLEGAL = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSWEEP_CACHE", str(tmp_path))
    return tmp_path


def test_exits_are_described_by_signal_name():
    assert describe_exit(-11) == "was killed by SIGSEGV (signal 11)"
    assert describe_exit(-4) == "was killed by SIGILL (signal 4)"
    assert describe_exit(2) == "exited with status 2"


def test_a_child_killed_by_a_signal_is_a_verdict_naming_it():
    assert "was killed by SIGSEGV" in run_child(SEGFAULT, timeout_s=60)
    assert "was killed by SIGILL" in run_child(ILLEGAL, timeout_s=60)
    assert run_child([sys.executable, "-c", "pass"], timeout_s=60) is None
    assert "hung" in run_child([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=1)


def test_an_ordinary_failure_is_inconclusive_not_a_crash():
    with pytest.raises(Inconclusive, match="exited with status 3"):
        run_child([sys.executable, "-c", "raise SystemExit(3)"], timeout_s=60)


def test_verdicts_are_cached_per_key_and_cpu(cache):
    calls = []

    def crashing():
        calls.append(1)
        return run_child(SEGFAULT, timeout_s=60)

    v = probe("demo", {"lib": "1.0"}, crashing)
    assert not v.usable and "SIGSEGV" in v.reason and cpu_identity()["cpu"] in v.reason
    again = probe("demo", {"lib": "1.0"}, crashing)
    assert not again.usable and "cached probe" in again.reason and len(calls) == 1
    other = probe("demo", {"lib": "2.0"}, lambda: None)  # a rebuilt library is probed again
    assert other.usable and "probe passed" in other.reason
    (saved,) = [json.loads(p.read_text()) for p in (cache / "probes").glob("demo-*.json") if "1.0" in p.read_text()]
    assert saved["key"]["lib"] == "1.0" and saved["key"]["cpu"] == cpu_identity()["cpu"] and saved["usable"] is False


def test_inconclusive_probes_are_off_for_the_run_and_not_cached():
    calls = []

    def broken_model():
        calls.append(1)
        raise Inconclusive("the model did not load")

    for _ in range(2):
        v = probe("demo-inconclusive", {}, broken_model)
        assert not v.usable and "inconclusive" in v.reason and "the model did not load" in v.reason
    assert len(calls) == 2


def test_forced_settings_are_not_probed_and_bad_ones_are_named():
    never = lambda: pytest.fail("a forced setting must not probe")  # noqa: E731
    assert decide("on", "backend.repack", "x", {}, never).usable
    off = decide("off", "backend.repack", "x", {}, never)
    assert not off.usable and "backend.repack=off" in off.reason
    with pytest.raises(ValueError, match=r"backend.repack='maybe' is not valid; use auto .*, on or off"):
        decide("maybe", "backend.repack", "x", {}, never)


def test_a_forced_repack_is_blamed_only_for_a_death_by_signal():
    from backends.cpu_probe import repack_forced_hint

    hint = repack_forced_hint("on", -11)
    assert "backend.repack=on forced" in hint and "backend.repack=auto" in hint and "backend.repack=off" in hint
    assert repack_forced_hint("auto", -11) == repack_forced_hint("off", -4) == ""  # not forced on
    assert repack_forced_hint("on", 1) == repack_forced_hint("on", None) == ""  # an ordinary exit, or none
