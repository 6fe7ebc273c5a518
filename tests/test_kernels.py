"""The native engine's CPU products (backends/native/kernels.py): chosen by measuring, cached per
CPU and torch build, and numerically the same product whichever is chosen. No speed is asserted:
which candidate wins depends on the machine."""
import json

import pytest
import torch

from backends.native import kernels


@pytest.fixture(scope="module", autouse=True)
def with_rowdot():
    """specsweep's own product built for this CPU (once per machine, in torch's extensions folder),
    so that every test here that goes over the candidates goes over it too."""
    kernels.load_rowdot()


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSWEEP_CACHE", str(tmp_path))
    saved = dict(kernels.PLANS)
    kernels.PLANS.clear()
    yield tmp_path
    kernels.PLANS.clear()
    kernels.PLANS.update(saved)


@pytest.mark.parametrize("n", [1, 2, 5, 70])
def test_every_candidate_computes_the_same_product(n):
    w, x = torch.randn(48, 32), torch.randn(n, 32)
    want = x @ w.T
    for name, fn in kernels.CANDIDATES.items():
        assert torch.allclose(fn(x, w), want, atol=1e-5), name


@pytest.mark.parametrize("n", [1, 2, 16])
def test_every_candidate_returns_f_linears_layout(n):
    """A strided result sends later kernels off their fast paths (SDPA over a q whose last
    dimension is not unit-stride runs the math kernel, not flash), a cost the tuner never sees:
    every candidate hands back what F.linear does, contiguous."""
    w, x = torch.randn(48, 32), torch.randn(n, 32)
    for name, fn in kernels.CANDIDATES.items():
        y = fn(x, w)
        assert y.is_contiguous() and y.stride() == (48, 1), name


def test_attention_gets_a_unit_stride_query_under_any_plan():
    """The attention's q, k and v come from the fused product whichever kernel the plan picks."""
    from backends.native.model import Attention, ModelArgs

    args = ModelArgs(arch="llama", vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=1, head_dim=8,
                     intermediate_size=64)
    attn = Attention(args, sliding=False)
    attn.fuse()
    w = attn.wqkv
    kernels.PLANS[(w.shape[0], w.shape[1], w.dtype)] = ((64, "transposed"),)
    x = torch.randn(16, 1, 32)
    cos, sin = torch.ones(16, 1, 1, 8), torch.zeros(16, 1, 1, 8)
    q, k, v = attn.project(x, cos, sin)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1


def test_a_candidate_must_beat_f_linear_by_the_margin():
    ladder = (1, 2, 4)
    timings = {"linear": {1: 1.0, 2: 1.0, 4: 1.0}, "transposed": {1: 0.97, 2: 0.5, 4: 1.2}}
    assert kernels.plan_from(timings, ladder) == ((1, "linear"), (2, "transposed"), (4, "linear"))


def test_pick_follows_the_ladder_and_untuned_shapes_use_f_linear():
    w = torch.randn(8, 4)
    assert kernels.pick(w, 3) is kernels.linear_plain
    kernels.PLANS[(8, 4, w.dtype)] = ((1, "linear"), (4, "transposed"), (16, "linear"))
    assert kernels.pick(w, 1) is kernels.linear_plain
    assert kernels.pick(w, 2) is kernels.linear_transposed and kernels.pick(w, 4) is kernels.linear_transposed
    assert kernels.pick(w, 5) is kernels.linear_plain and kernels.pick(w, 500) is kernels.linear_plain


def test_tune_measures_once_then_reads_the_plan_keyed_by_cpu_torch_and_threads(fresh):
    ws = [torch.randn(64, 32), torch.randn(64, 32), torch.randn(32, 64)]  # two shapes
    first = kernels.tune(ws)
    assert len(first) == 2 and all("measured now" in v for v in first.values())
    files = list((fresh / "kernels").glob("*.json"))
    assert len(files) == 2
    saved = json.loads(files[0].read_text())
    assert {"cpu", "cpu_flags_sha", "torch", "threads", "shape", "dtype"} <= set(saved["key"])
    assert set(saved["timings_s"]) == set(kernels.CANDIDATES)
    kernels.PLANS.clear()
    again = kernels.tune(ws)
    assert all("cached" in v for v in again.values()) and len(kernels.PLANS) == 2
    # a plan naming a kernel this version does not have is measured again, not trusted
    saved["plan"][0][1] = "gone"
    files[0].write_text(json.dumps(saved))
    assert sum("measured now" in v for v in kernels.tune(ws).values()) == 1


def test_the_engine_records_its_plan(tiny_llama):
    from backends.native import NativeBackend

    b = NativeBackend({"path": str(tiny_llama)}, {"name": "ngram"}, num_speculative_tokens=3)
    plans = b.describe()["kernels"]
    assert plans and all("up to" in v for v in plans.values())
    # the matrices the forward multiplies: q/k/v and gate/up fused (model.fuse_projections), not their parts
    shapes = {f"{p.shape[0]}x{p.shape[1]} float32" for p in b.model.matrices()}
    attn, ffn = b.model.layers[0].attn, b.model.layers[0].ffn
    assert f"{attn.wqkv.shape[0]}x{attn.wqkv.shape[1]} float32" in shapes and ffn.w_gate_up.shape[0] == 2 * ffn.w_up.weight.shape[0]
    assert set(plans) == shapes


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_projections_give_the_separate_products_logits(tmp_path, arch):
    """load_model fuses each layer's q/k/v and gate/up products (fewer, larger products read
    nearer the machine's bandwidth): same logits as the separate products, biases included
    (qwen2 has q/k/v biases), and the separate weights are views of the fused ones, not copies."""
    from backends.native.loading import load_model
    from bench.tiny_models import build_tiny_llama

    model, *_ = load_model(str(build_tiny_llama(tmp_path / arch, arch=arch)))
    attn, ffn = model.layers[0].attn, model.layers[0].ffn
    assert attn.wqkv is not None and ffn.w_gate_up is not None and (attn.bqkv is not None) == (arch == "qwen2")
    assert attn.wv.weight.untyped_storage().data_ptr() == attn.wqkv.untyped_storage().data_ptr()
    assert ffn.w_up.weight.untyped_storage().data_ptr() == ffn.w_gate_up.untyped_storage().data_ptr()
    ids, pos = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4]]), torch.arange(8)[None]
    with torch.inference_mode():
        model.setup_cache(1, 16)
        fused = model(ids, pos)
        for layer in model.layers:
            layer.attn.wqkv = layer.attn.bqkv = layer.ffn.w_gate_up = None
        separate = model(ids, pos)
    assert fused.shape == separate.shape and fused.abs().max() > 0
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)


def test_a_candidate_that_cannot_run_a_weight_is_left_out_of_its_plan(monkeypatch):
    """oneDNN (or any candidate) may refuse a dtype on some CPU: measure times the others, and the
    plan never names the one that failed."""
    def refuses(x2, w):
        raise RuntimeError("not for this dtype")

    monkeypatch.setitem(kernels.CANDIDATES, "refuses", refuses)
    timings = kernels.measure(torch.randn(64, 32), ladder=(1, 4), rounds=1)
    assert "refuses" not in timings and "linear" in timings
    assert all(name != "refuses" for _, name in kernels.plan_from(timings, (1, 4)))


def test_onednn_is_a_candidate_wherever_torch_has_it():
    """On an x86 torch build with oneDNN its inner product is timed beside F.linear (on a 2-core
    AVX-512 AMD EPYC it was the fastest at 8-16 rows of Gemma 3's output matrix)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64") or not torch.backends.mkldnn.is_available():
        assert "onednn" not in kernels.CANDIDATES  # no oneDNN in this torch build: the candidate is rightly absent
        return
    assert kernels.CANDIDATES.get("onednn") is kernels.linear_onednn


@pytest.mark.parametrize("kernel", ["rowdot", "rowblock"])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 8, 9, 17])
@pytest.mark.parametrize("n, k", [(48, 32), (37, 40), (38, 24), (640, 1024)])
def test_rowdot_builds_here_and_computes_the_same_product(kernel, m, n, k):
    """rowdot.cpp is built on this machine (a C++ compiler and ninja are part of the install), and
    both its products give F.linear's for any row count (every path: 1-8 rows, more in groups of
    8), weight-row counts no block of rowblock divides (37, 38), inner sizes that are no multiple
    of the vector lanes (40, 24), and a strided x; F.linear's layout."""
    assert kernels.load_rowdot() is None and kernels.CANDIDATES[kernel] is kernels.OWN_PRODUCTS[kernel]
    w, x = torch.randn(n, k), torch.randn(k, m).T  # x not contiguous
    y = kernels.CANDIDATES[kernel](x, w)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-4)
    assert y.is_contiguous() and y.shape == (m, n)


@pytest.mark.parametrize("kernel", ["rowdot", "rowblock"])
def test_rowdot_refuses_what_it_does_not_compute_and_the_tuner_leaves_it_out(kernel):
    assert kernels.load_rowdot() is None
    w16 = torch.randn(64, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32 only"):
        kernels.CANDIDATES[kernel](torch.randn(2, 32, dtype=torch.bfloat16), w16)
    with pytest.raises(RuntimeError, match="contiguous weight"):
        kernels.CANDIDATES[kernel](torch.randn(2, 32), torch.randn(32, 64).T)
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and w \[N, K\]"):
        kernels.CANDIDATES[kernel](torch.randn(2, 31), torch.randn(64, 32))
    assert kernel not in kernels.measure(w16, ladder=(1, 2), rounds=1)


def test_rowdot_runs_on_torchs_own_openmp_runtime():
    """Built with -fopenmp, its parallel loop binds to the OpenMP runtime torch loaded (one libgomp
    in the process), so torch.set_num_threads sets its threads too; a second runtime would run
    threads of its own beside torch's. In a process of its own: other libraries a test session
    loads (llama.cpp's) may bring an OpenMP runtime of theirs."""
    import subprocess
    import sys

    script = ("import torch\n"
              "from backends.native import kernels\n"
              "assert kernels.load_rowdot() is None\n"
              "kernels.linear_rowdot(torch.randn(1, 32), torch.randn(64, 32))\n"
              "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'gomp' in l.split()[-1]}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    runtimes = eval(out.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1 and "torch" in runtimes[0], runtimes


def test_a_rowdot_that_cannot_be_built_leaves_the_others_and_says_why(tmp_path, monkeypatch):
    broken = tmp_path / "rowdot.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "ROWDOT_SOURCE", broken)
    monkeypatch.setattr(kernels, "ROWDOT", {})
    monkeypatch.setattr(kernels, "CANDIDATES", {k: v for k, v in kernels.CANDIDATES.items() if k not in kernels.OWN_PRODUCTS})
    said = []
    why = kernels.load_rowdot(said.append)
    assert why and not set(kernels.OWN_PRODUCTS) & set(kernels.CANDIDATES) and any("not available here" in s for s in said)
    summary = kernels.tune([torch.randn(16, 8)])
    assert summary["rowdot"] == f"unavailable: {why}" and "16x8 float32" in summary


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_run():
    """torch's extension builder waits, with no limit, for its lock file to go; a build killed
    midway leaves it behind. Here a real builder is killed while it holds the build (SIGKILL, as
    a stopped run or a job's time limit does), then a new process loads rowdot.cpp: it must remove
    the dead builder's lock and load, not wait forever."""
    import os
    import signal
    import subprocess
    import sys

    assert kernels.load_rowdot() is None
    lock = kernels.ROWDOT["build_dir"] / "lock"
    # a builder that takes torch's lock the way torch does, then dies holding it
    holder = subprocess.Popen([sys.executable, "-c", "from torch.utils.file_baton import FileBaton; import sys, time\n"
                               f"assert FileBaton({str(lock)!r}).try_acquire(); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert lock.exists()
    out = subprocess.run([sys.executable, "-c", "from backends.native import kernels\n"
                          "print(kernels.load_rowdot(print))"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "None", out.stdout + out.stderr[-2000:]
    assert "left by a build that was stopped" in out.stdout and not lock.exists()


def test_a_second_builder_waits_for_the_first_and_says_so(tmp_path):
    """One inter-process lock (bench.backend.file_lock) serves the build: a second process finding
    it held says it waits, then waits until the holder lets go; with wait=False it is refused at
    once (specsweep-train-eagle's folders)."""
    import subprocess
    import sys
    import time

    from bench.backend import LockBusy, file_lock

    flock = tmp_path / "specsweep.flock"
    with file_lock(flock):
        with pytest.raises(LockBusy):
            with file_lock(flock, wait=False):
                pass
        waiter = subprocess.Popen([sys.executable, "-c", "from pathlib import Path\nfrom backends.native import kernels\n"
                                   f"with kernels._build_held(Path({str(tmp_path)!r}), print):\n    print('building', flush=True)"],
                                  stdout=subprocess.PIPE, text=True)
        assert "another process is building" in waiter.stdout.readline()
        time.sleep(0.5)
        assert waiter.poll() is None  # still waiting while the lock is held here
    out, _ = waiter.communicate(timeout=60)
    assert waiter.returncode == 0 and out.strip() == "building"
