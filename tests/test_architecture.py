"""docs/architecture.md's rules, checked on the source: who may import what (parsed imports,
top-level and inside functions), and the harness never tests a method's or an engine's name."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARNESS_NEVER_FROM_ADAPTERS = ("bench.runner", "bench.metrics", "bench.report", "bench.decision",
                               "bench.gate", "bench.cli", "bench.sweeper", "bench.summary", "bench.load", "bench.measure",
                               "bench.lossless", "bench.jobtimer")


def modules(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Every module a file imports (relative imports resolved), wherever the import statement is,
    or with top_level_only those in its module body (what it needs while it loads)."""
    tree = ast.parse(path.read_text())
    pkg = module_name(path).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    out = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}  # `from bench import runner`
    return out


def offending(paths, forbidden) -> list[str]:
    return [f"{p.relative_to(ROOT)} imports {m}" for p in paths for m in sorted(imports(p))
            if any(m == f or m.startswith(f + ".") for f in forbidden)]


# backends/native/train_eagle.py is a tool (specsweep-train-eagle), not an adapter: it reports a
# trained head's acceptance with the harness's own definition (bench.metrics)
TOOLS = ("train_eagle",)


def test_adapters_never_import_the_harness():
    assert not offending([p for p in modules("backends") if p.stem not in TOOLS], HARNESS_NEVER_FROM_ADAPTERS)


def test_the_adapter_contract_imports_nothing_of_the_project():
    assert not offending([ROOT / "bench" / "backend.py"], ("bench", "backends", "workloads"))


def test_serving_and_processes_import_no_adapter():
    helpers = ("serving", "processes", "cpu_probe", "__init__")  # cpu_probe names a crash's signal for both
    adapters = [module_name(p) for p in modules("backends") if p.stem not in helpers]
    assert not offending([ROOT / "backends" / "serving.py", ROOT / "backends" / "processes.py"], adapters)


def test_the_harness_reaches_adapters_only_through_their_registered_configs():
    """bench/ names no adapter module: engines come in through Hydra's _target_ (and bench/config.py
    registers the typed nodes the `backends` package lists)."""
    adapters = [module_name(p) for p in modules("backends") if p.name != "__init__.py"]
    assert not offending(modules("bench"), adapters)


def test_metrics_summary_and_oracle_stay_below_the_runner():
    assert not offending(modules("bench/metrics"), ("bench.runner", "bench.report", "backends", "bench.cli",
                                                    "bench.lossless"))
    # the measurement stage records, the metrics compute: measure never computes a metric
    assert not offending([ROOT / "bench" / "measure.py"], ("bench.metrics", "bench.runner", "bench.lossless", "backends"))
    assert not offending([ROOT / "bench" / "lossless.py"], ("bench.runner", "bench.measure", "backends"))
    assert not offending([ROOT / "bench" / "summary.py"], ("bench.runner", "bench.report", "bench.gate", "backends"))
    assert not offending(modules("bench/oracle"), ("bench.runner", "bench.report", "backends", "bench.cli"))


def _names() -> set[str]:
    from bench.method_settings import METHODS

    methods = set(METHODS)
    from hydra.utils import get_class

    import backends
    engines = {get_class(path).name for path in backends.CONFIGS}
    engines |= {p.stem for p in (ROOT / "conf" / "backend").glob("*.yaml")}
    assert {"native", "vllm_server", "openai_endpoint"} <= engines and "ngram" in methods
    return methods | engines


@pytest.mark.parametrize("path", modules("bench"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_harness_never_tests_a_method_or_engine_name(path):
    """No `x == "ngram"`, `x != "autoregressive"`, `x in ("vllm", ...)` in bench/: what a method or
    engine can do is declared by its config (drafter kind, speculative) and its adapter."""
    names = _names()
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            text = " ".join(ast.unparse(x) for x in sides if not isinstance(x, ast.Constant))
            # a comparison of a method's or engine's name (not of a drafter kind or a policy kind)
            if not any(w in text for w in ("method", "backend", "engine")) or "drafter" in text or "kind" in text:
                continue
            consts = [c for x in sides for c in ([x] + list(getattr(x, "elts", [])))
                      if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            bad += [f"line {node.lineno}: {c.value!r}" for c in consts if c.value in names]
    assert not bad, f"{path.relative_to(ROOT)} compares with a method or engine name: {bad}"


def test_no_import_cycle_among_the_projects_modules():
    """A module never needs, while it loads, a module that needs it back (the oracle's policies
    register themselves instead of policies.py importing adaptive.py and dp.py at its bottom)."""
    files = {module_name(p): p for folder in ("bench", "backends", "workloads") for p in modules(folder)}
    graph = {m: {d for d in imports(p, top_level_only=True) if d in files and d != m} for m, p in files.items()}
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for d in sorted(graph[m]):
            visit(d)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_http_goes_through_serving_only():
    """Every HTTP request of an adapter goes through backends/serving.py (its protocols, its one
    /metrics reader, its health poll); other modules may name httpx's exceptions, not call it."""
    calls = []
    for path in modules("backends") + modules("bench"):
        if path.name == "serving.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "httpx"):
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno} httpx.{node.func.attr}")
    assert not calls, calls


def test_no_adapter_writes_a_method_knobs_default_again():
    """A method knob's default is written once, in its typed node (bench/method_settings.py); adapters
    read knobs through bench.methods.knobs, never `method.get("min_ngram", 1)` with a default of their own."""
    from bench.method_settings import method_defaults_table

    names = {k for d in method_defaults_table().values() for k in d} - {"name", "speculative", "drafter"}
    allowed: set = set()
    found = []
    for path in modules("backends"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value in names
                    and (str(path.relative_to(ROOT)), node.args[0].value) not in allowed):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .get({node.args[0].value!r}, ...)")
    assert not found, found
