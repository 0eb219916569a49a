"""The layering, checked on the source (ast; no module is imported): no import cycles;
config.py imports nothing of kvjax; host structures import no JAX; device code imports no
engine, harness, benchmark or CLI; experiments import no benchmark; no file over 400 lines.

Imports under `if TYPE_CHECKING:` are annotations only and do not count; imports inside
functions (lazy ones) count like any other; `importlib` calls (the experiment registry's)
are not seen. The cycle check also follows the package `__init__` an import runs (all but
the root's, which re-exports everything by design); the layering checks follow what each
module's own code imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
MAX_LINES = 400

# Host code: plain Python + numpy (what it imports of kvjax must be host code too).
HOST = ["kvjax.config", "kvjax.errors", "kvjax.cache.allocator", "kvjax.cache.trie",
        "kvjax.cache.identity", "kvjax.decode.batching", "kvjax.decode.prompts",
        "kvjax.engine.requests", "kvjax.engine.scheduler", "kvjax.engine.results",
        "kvjax.engine.stats", "kvjax.lab.workloads", "kvjax.lab.progress",
        "kvjax.speculative.gamma", "kvjax.speculative.stats"]
# Device code: the model, cache pytrees, steps and the on-device speculative loop.
DEVICE_PREFIXES = ["kvjax.model", "kvjax.cache.paged", "kvjax.cache.dense",
                   "kvjax.decode.steps", "kvjax.decode.sampling", "kvjax.decode.prefill",
                   "kvjax.speculative.rules", "kvjax.speculative.loop",
                   "kvjax.speculative.ngram_device", "kvjax.sharding"]
ABOVE_DEVICE = ["kvjax.engine", "kvjax.lab", "kvjax.bench", "kvjax.cli", "kvjax.train",
                "kvjax.speculative.plugin", "experiments"]
JAX = ("jax", "jaxlib", "flax", "optax", "chex", "orbax")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted([*ROOT.glob("kvjax/**/*.py"), *ROOT.glob("experiments/**/*.py")]):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str) -> set[str]:
    """Every module `name` imports: kvjax/experiments modules by name, others by their
    top-level package."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # `from pkg import module` imports the module
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m if m in MODULES else m.split(".")[0] for m in found} - {name}


GRAPH = {name: _imports(name) for name in MODULES}


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _with_packages(name: str, deps: set[str]) -> set[str]:
    """`deps` and the package `__init__`s importing them runs (not the root's, nor those
    of `name`'s own packages, which are being imported already when `name` runs)."""
    out = set(deps)
    for dep in deps:
        parts = dep.split(".")
        for i in range(2, len(parts)):
            package = ".".join(parts[:i])
            if package in MODULES and not _under(name, [package]):
                out.add(package)
    return out


RUNTIME_GRAPH = {name: _with_packages(name, deps) for name, deps in GRAPH.items()}


def _closure(name: str) -> set[str]:
    """What importing `name` imports, transitively (kvjax/experiments edges followed)."""
    seen, todo = set(), [name]
    while todo:
        for dep in GRAPH.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def _cycle(graph: dict[str, set[str]] = RUNTIME_GRAPH) -> list[str] | None:
    """One import cycle among the modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for dep in sorted(graph[name] & MODULES.keys()):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := walk(dep)):
                return found
        path.pop()
        state[name] = 2
        return None

    for name in MODULES:
        if name not in state and (found := walk(name)):
            return found
    return None


def test_the_layout_is_the_design_cards():
    for part in ["kvjax/config.py", "kvjax/errors.py", "kvjax/cli.py", "kvjax/cache/pool.py",
                 "kvjax/engine/engine.py", "kvjax/engine/scheduler.py",
                 "kvjax/engine/runner.py", "kvjax/engine/stats.py",
                 "kvjax/speculative/__init__.py", "experiments/__init__.py"]:
        assert (ROOT / part).is_file(), part
    root_modules = sorted(p.name for p in (ROOT / "kvjax").glob("*.py"))
    assert len(root_modules) <= 8, root_modules


def test_no_import_cycle():
    assert _cycle() is None, " -> ".join(_cycle())


@pytest.mark.parametrize("name", ["kvjax.config", "kvjax.errors"])
def test_the_bottom_imports_nothing_of_kvjax(name):
    assert not {m for m in GRAPH[name] if _under(m, ["kvjax"])}


@pytest.mark.parametrize("name", HOST)
def test_host_code_imports_no_jax(name):
    assert name in MODULES
    reached = {name} | _closure(name)
    assert not {m for m in reached if m in JAX}, sorted(m for m in reached if m in JAX)
    assert not {m for m in reached if _under(m, JAX)}


def test_device_code_imports_no_engine_harness_benchmark_or_cli():
    device = [m for m in MODULES if _under(m, DEVICE_PREFIXES)]
    assert len(device) >= 12
    for name in device:
        above = sorted(m for m in _closure(name) if _under(m, ABOVE_DEVICE))
        assert not above, f"{name} imports {above}"


def test_experiments_import_no_benchmark():
    experiments = [m for m in MODULES if _under(m, ["experiments"])]
    assert len(experiments) >= 9
    for name in experiments:
        bench = sorted(m for m in _closure(name) if _under(m, ["kvjax.bench"]))
        assert not bench, f"{name} imports {bench}"
    users = sorted(m for m, deps in GRAPH.items() if not _under(m, ["kvjax.bench", "kvjax.cli"])
                   and any(_under(d, ["kvjax.bench"]) for d in deps))
    assert not users, f"only the CLI runs benchmarks: {users}"


def test_no_source_file_over_400_lines():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_checks_can_fail():
    """The walker finds what it must: a known edge, a lazy import, an injected cycle."""
    assert "kvjax.cache.trie" in GRAPH["kvjax.engine.scheduler"]
    assert "kvjax.cache.pool" not in GRAPH["kvjax.engine.scheduler"]  # TYPE_CHECKING only
    assert "kvjax.bench.decode" in GRAPH["kvjax.cli"]  # a lazy import inside a function
    assert "jax" in _closure("kvjax.engine.engine")
    assert "kvjax.engine" in RUNTIME_GRAPH["kvjax.lab.workloads"]  # the __init__ it runs
    RUNTIME_GRAPH["kvjax.config"].add("kvjax.engine.engine")
    try:
        assert _cycle() is not None
    finally:
        RUNTIME_GRAPH["kvjax.config"].discard("kvjax.engine.engine")
