"""The layering, checked on the source (ast; no module is imported, except by the one test
that backs the host rule with a real import in a fresh process): no import cycles;
config.py imports nothing of kvjax; host structures load no JAX; device code loads no
engine, harness, benchmark or CLI; experiments load no benchmark; no source file (kvjax/,
experiments/) over 400 lines. Test files are not held to the line limit.

"Loads" is what `import name` executes in a fresh process: the module, the package
`__init__`s above it (importing `kvjax.engine.requests` runs `kvjax/__init__.py` and
`kvjax/engine/__init__.py` first), and the same for everything those import, transitively.
`from pkg import name` imports the submodule `pkg.name` where there is one; where `name` is
in the package's lazy table (`_EXPORTS` / `_SUBMODULES`, served by a PEP 562 `__getattr__`),
it imports the module the table names, and so does an attribute chain such as
`kvjax.speculative.make_drafter` written in the code. `kvjax/__init__.py` is loaded with
every host module, so it must load no JAX either: it imports `backend` and serves the rest
from its lazy table.

Imports under `if TYPE_CHECKING:` never execute and do not count. Imports inside functions
(lazy ones) count like any other: the test cannot tell whether a host path calls the
function, and a host module that needs JAX for one function should leave that function to
device code. `importlib` calls (the experiment registry's, the lazy tables' `__getattr__`)
are not seen; the lazy tables stand in for theirs. The cycle check leaves out a package's
`__init__` when the importer is inside that package (it is already being imported then)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
MAX_LINES = 400

# Host code: plain Python + numpy (what it imports of kvjax must be host code too).
HOST = ["kvjax.config", "kvjax.errors", "kvjax.cache.allocator", "kvjax.cache.trie",
        "kvjax.cache.identity", "kvjax.cache.admission", "kvjax.decode.batching",
        "kvjax.decode.prompts",
        "kvjax.engine.requests", "kvjax.engine.scheduler", "kvjax.engine.results",
        "kvjax.engine.stats", "kvjax.engine.numerics_policy", "kvjax.lab.workloads",
        "kvjax.lab.progress", "kvjax.lab.replay", "kvjax.model.plan", "kvjax.data",
        "kvjax.data.sharegpt", "kvjax.data.mtbench",
        "kvjax.speculative.gamma", "kvjax.speculative.stats", "kvjax.cpu.build"]
# Device code: the model, cache pytrees, steps and the on-device speculative loop.
DEVICE_PREFIXES = ["kvjax.model", "kvjax.cache.paged", "kvjax.cache.dense",
                   "kvjax.decode.steps", "kvjax.decode.sampling", "kvjax.decode.prefill",
                   "kvjax.speculative.rules", "kvjax.speculative.loop",
                   "kvjax.speculative.ngram_device", "kvjax.sharding", "kvjax.cpu.product"]
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


def _lazy(package: str) -> dict[str, str]:
    """The names a package's `__getattr__` loads on first use, each -> its module."""
    table: dict[str, str] = {}
    for node in ast.parse(MODULES[package].read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "_EXPORTS":
                for module, names in ast.literal_eval(node.value).items():
                    table.update(dict.fromkeys(names, module))
            elif node.targets[0].id == "_SUBMODULES":
                table.update({sub: f"{package}.{sub}" for sub in ast.literal_eval(node.value)})
    return table


LAZY = {name: table for name, path in MODULES.items()
        if path.name == "__init__.py" and (table := _lazy(name))}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)):
        return f"{base}.{node.attr}"
    return None


def _imports(name: str, source: str | None = None) -> set[str]:
    """Every module `name` imports (its own code, not the `__init__`s that run first):
    kvjax/experiments modules by name, others by their top-level package. `source` stands
    in for the file of a module that does not exist."""
    path = MODULES.get(name)
    is_package = path is not None and path.name == "__init__.py"
    package = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()

    def named(base: str, attr: str) -> str:
        """What `from base import attr` (or `base.attr`) imports."""
        if f"{base}.{attr}" in MODULES:
            return f"{base}.{attr}"
        return LAZY.get(base, {}).get(attr, base)

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
            found.update(named(base, alias.name) for alias in node.names)
        elif isinstance(node, ast.Attribute) and (chain := _dotted(node)):
            parts = chain.split(".")
            found.update(LAZY[base][parts[i]] for i in range(1, len(parts))
                         if (base := ".".join(parts[:i])) in LAZY and parts[i] in LAZY[base])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source if source is not None else path.read_text()))
    return {m if m in MODULES else m.split(".")[0] for m in found} - {name}


GRAPH = {name: _imports(name) for name in MODULES}


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _packages(name: str) -> list[str]:
    """The package `__init__`s importing `name` runs before `name` itself, outermost first."""
    parts = name.split(".")
    return [p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in MODULES]


def _with_packages(name: str, deps: set[str]) -> set[str]:
    """`deps` and the package `__init__`s importing them runs (not those of `name`'s own
    packages, which are being imported already when `name` runs)."""
    return set(deps) | {p for dep in deps for p in _packages(dep) if not _under(name, [p])}


RUNTIME_GRAPH = {name: _with_packages(name, deps) for name, deps in GRAPH.items()}


def _loads(name: str, graph: dict[str, set[str]] = RUNTIME_GRAPH) -> dict[str, str | None]:
    """Everything `import name` executes in a fresh process (kvjax/experiments modules by
    name, others by top-level package), each -> the module that brought it in."""
    came_from: dict[str, str | None] = dict.fromkeys([*_packages(name), name])
    todo = list(came_from)
    while todo:
        current = todo.pop(0)
        for dep in sorted(graph.get(current, ())):
            if dep not in came_from:
                came_from[dep] = current
                todo.append(dep)
    return came_from


def _chain(loaded: dict[str, str | None], target: str) -> str:
    """How `target` came to be loaded: "a -> b -> target"."""
    chain = [target]
    while (before := loaded[chain[-1]]) is not None:
        chain.append(before)
    return " -> ".join(reversed(chain))


def _reaches_jax(name: str, graph: dict[str, set[str]] = RUNTIME_GRAPH) -> list[str]:
    loaded = _loads(name, graph)
    return [_chain(loaded, m) for m in sorted(loaded) if _under(m, JAX)]


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
    assert not _reaches_jax(name)


def test_host_code_imports_no_jax_when_imported():
    """The host rule on a real import: the host modules one after another in one fresh
    process, then the public host names of the lazy packages; no module of JAX's family
    may be loaded after any of them."""
    statements = [*(f"import {name}" for name in HOST),
                  "import kvjax; kvjax.Request; kvjax.speculative.SpecStats"]
    code = ("import sys\n"
            f"for statement in {statements!r}:\n"
            "    exec(statement)\n"
            f"    jax = sorted(m for m in sys.modules if m.split('.')[0] in {JAX!r})\n"
            "    assert not jax, f'{statement} loads {jax[:5]}'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _binds(name: str) -> set[str]:
    """The names a module binds at its top level."""
    out: set[str] = set()
    for node in ast.parse(MODULES[name].read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
    return out


@pytest.mark.parametrize("package", sorted(LAZY))
def test_lazy_names_are_defined_where_the_table_says(package):
    for attr, module in LAZY[package].items():
        assert module in MODULES, (package, attr, module)
        if module != f"{package}.{attr}":
            assert attr in _binds(module), f"{package}.{attr}: {module} has no {attr}"


@pytest.mark.parametrize("package", sorted(LAZY))
def test_static_tools_see_every_lazy_name(package):
    """A lazy package's `if TYPE_CHECKING:` imports (what type checkers and IDEs read) name
    exactly its `_EXPORTS` table, and its `__all__` lists every name it exports."""
    tree = ast.parse(MODULES[package].read_text())
    static: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for imp in node.body:
                static.update(dict.fromkeys((a.name for a in imp.names), imp.module))
    exports = {n: m for n, m in LAZY[package].items() if m != f"{package}.{n}"}
    assert static == exports
    public = next(ast.literal_eval(node.value) for node in tree.body
                  if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                  and node.targets[0].id == "__all__")
    assert set(exports) <= set(public)


def test_device_code_imports_no_engine_harness_benchmark_or_cli():
    device = [m for m in MODULES if _under(m, DEVICE_PREFIXES)]
    assert len(device) >= 12
    for name in device:
        loaded = _loads(name)
        above = [_chain(loaded, m) for m in sorted(loaded) if _under(m, ABOVE_DEVICE)]
        assert not above, f"{name} loads {above}"


def test_experiments_import_no_benchmark():
    experiments = [m for m in MODULES if _under(m, ["experiments"])]
    assert len(experiments) >= 9
    for name in experiments:
        loaded = _loads(name)
        bench = [_chain(loaded, m) for m in sorted(loaded) if _under(m, ["kvjax.bench"])]
        assert not bench, f"{name} loads {bench}"
    users = sorted(m for m, deps in GRAPH.items() if not _under(m, ["kvjax.bench", "kvjax.cli"])
                   and any(_under(d, ["kvjax.bench"]) for d in deps))
    assert not users, f"only the CLI runs benchmarks: {users}"


# The engine's read-only views of the target pool, for users to inspect: (file, property).
PAGE_VIEWS = {("kvjax/engine/engine.py", "allocator"), ("kvjax/engine/engine.py", "trie")}


def _page_breaches(rel: str, source: str) -> list[str]:
    """Where code reaches a pool's allocator or trie (`.allocator`, `.trie`) or stores a
    device cache into an attribute (`x.cache = ...`, also inside a tuple target), outside
    the PAGE_VIEWS properties."""
    tree = ast.parse(source)
    views = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
             and (rel, f.name) in PAGE_VIEWS
             and any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)]
    allowed = {id(n) for f in views for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if id(node) in allowed:
            continue
        if isinstance(node, ast.Attribute) and node.attr in ("allocator", "trie"):
            out.append(f"{rel}:{node.lineno} .{node.attr}")
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets += t.elts
            elif isinstance(t, ast.Starred):
                targets.append(t.value)
            elif isinstance(t, ast.Attribute) and t.attr == "cache":
                out.append(f"{rel}:{t.lineno} .cache =")
    return out


def test_pages_have_one_owner():
    """Only `kvjax.cache` (the `KVCacheManager` over its `PagePool`s) allocates, shares,
    inserts into or evicts from a trie, or stores a step's new cache: elsewhere no code
    reaches `.allocator` or `.trie` or assigns `.cache`; the engine's read-only views
    (`Engine.allocator`, `Engine.trie`) are the exception."""
    breaches = [b for name, path in MODULES.items() if not _under(name, ["kvjax.cache"])
                for b in _page_breaches(str(path.relative_to(ROOT)), path.read_text())]
    assert not breaches, breaches


@pytest.mark.parametrize(("source", "breaches"), [
    ("pool.trie.insert(ns, tokens, salts, digests, pages)", 1),
    ("logits, pool.cache = step(pool.cache)", 1),
    ("out, (a, *self.pool.cache) = f()", 1),
    ("pages = engine.pool.allocator.allocate(2)", 1),
    ("logits = kv.run(lambda cache: step(cache))\ncache = 1", 0),
    ("class Engine:\n    @property\n    def trie(self):\n        return self.kv.target.trie", 0),
    ("class Engine:\n    def trie(self):\n        return self.kv.target.trie", 1),
])
def test_the_page_owner_check_can_fail(source, breaches):
    assert len(_page_breaches("kvjax/engine/engine.py", source)) == breaches


def test_no_source_file_over_400_lines():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


# Host modules that do not exist, each -> whether importing it loads JAX.
FAKE_HOST = {
    "from kvjax.io import load": True,  # kvjax/io/__init__.py imports JAX
    "import kvjax.sharding.plan": True,  # so does kvjax/sharding/__init__.py
    "from kvjax.engine import Engine": True,  # a lazy name: its module imports JAX
    "from kvjax import Engine": True,
    "import kvjax\ndef f():\n    return kvjax.speculative.make_drafter": True,
    "from kvjax.engine import Request": False,  # the package's eager, host part
    "from kvjax.speculative import SpecStats": False,
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvjax.engine.engine": False,
}


def test_the_checks_can_fail():
    """The walker finds what it must: a known edge, a lazy import, the package `__init__`s
    an import runs, the lazy tables, an injected cycle, and the fake host modules above."""
    assert "kvjax.cache.admission" in GRAPH["kvjax.engine.scheduler"]
    assert "kvjax.cache.pool" not in GRAPH["kvjax.cache.admission"]  # TYPE_CHECKING only
    assert "kvjax.decode.generate" in GRAPH["kvjax.cli"]  # a lazy import inside a function
    assert "jax" in _loads("kvjax.engine.engine")
    assert "kvjax.engine" in RUNTIME_GRAPH["kvjax.lab.workloads"]  # the __init__ it runs
    assert {"kvjax", "kvjax.cache"} <= _loads("kvjax.cache.trie").keys()
    assert LAZY["kvjax"]["Engine"] == "kvjax.engine.engine"
    for source, loads_jax in FAKE_HOST.items():
        fake = "kvjax.cache.fake"
        graph = {**RUNTIME_GRAPH, fake: _with_packages(fake, _imports(fake, source))}
        assert bool(_reaches_jax(fake, graph)) == loads_jax, source
    RUNTIME_GRAPH["kvjax.config"].add("kvjax.engine.engine")
    try:
        assert _cycle() is not None
    finally:
        RUNTIME_GRAPH["kvjax.config"].discard("kvjax.engine.engine")


def test_the_quick_tier_names_files_that_exist():
    """`scripts/test --quick` skips the files tests/quick_skip.txt names: each must exist
    (a renamed file would otherwise join the quick tier unseen)."""
    root = Path(__file__).resolve().parents[1]
    names = [line.split("#")[0].strip() for line in
             (root / "tests/quick_skip.txt").read_text().splitlines()]
    names = [n for n in names if n]
    assert len(names) >= 10
    for name in names:
        assert (root / name).is_file(), name
