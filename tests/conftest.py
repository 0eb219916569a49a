"""Suite-wide fixtures, the XLA compilation cache test runs keep, and the host line."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import jax
import pytest

from kvjax.backend import cache_home
from kvjax.decode.compile_cache import host_folder, prune

# Test modules compile many of the same programs (the engine tests share one model and cache
# shape), every module drops its compiled code (below), and every run compiles what the run
# before it compiled. A persistent compilation cache kept across runs turns those compiles
# into loads of the same executables (the same machine code, so every bitwise comparison
# holds as before: tests/test_compile_cache.py checks a load against a compile). It lives in
# kvjax's folder of the user's cache folder, `xla-tests` (apart from the programs users'
# processes keep in `xla`), in the CPU's subfolder as kvjax.decode.compile_cache keeps them.
# `KVJAX_TEST_XLA_CACHE` names another folder (an empty one for a cold run; the CPU's
# subfolder is made there as well); the first process to load this file (pytest itself, or
# the xdist controller) sets it for the workers it starts and keeps the folder within
# `TEST_CACHE_BYTES`, dropping the entries used longest ago. A run killed while an entry was
# written may leave it cut short: JAX warns and compiles that program again; deleting the
# folder clears it.
_CACHE_ENV = "KVJAX_TEST_XLA_CACHE"
TEST_CACHE_BYTES = 4 << 30
_OWNER = _CACHE_ENV not in os.environ
if _OWNER:
    os.environ[_CACHE_ENV] = str(cache_home() / "xla-tests")
_FOLDER = host_folder(Path(os.environ[_CACHE_ENV]))  # this CPU's programs
_FOLDER.mkdir(parents=True, exist_ok=True)
if _OWNER:
    prune(_FOLDER, TEST_CACHE_BYTES)
# the processes tests start (docs' blocks, the CLI, mesh checks) cache there too, as in a
# user's own JAX cache (which kvjax leaves as configured): one folder for every kvjax source,
# where kvjax's own per-source folder would compile their programs again after every edit
os.environ.setdefault("KVJAX_XLA_CACHE", os.environ[_CACHE_ENV])
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_FOLDER))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# kvjax's kept steps (`kvjax.decode.programs`) are on as for users, in `programs/` of that
# folder: keyed by kvjax's source, so after an edit each step is traced once, its program
# read from JAX's cache above (which spans sources) and kept again; a second run traces
# none. The folder's bound drops the entries of sources no longer run (used longest ago).
jax.config.update("jax_compilation_cache_dir", str(_FOLDER))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The host's CPU and vector instruction sets after the failures (and under -q): XLA and
    kvjax's C++ pick kernels by them, so a bitwise failure reads with its host; and the
    compilation cache the run used."""
    from kvjax.backend import host_cpu

    terminalreporter.write_line(f"host CPU: {host_cpu()}")
    terminalreporter.write_line(f"XLA compilation cache: {_FOLDER}")


# Files that take a minute or more of one worker, longest first (`--durations` on two
# cores). `scripts/test` hands whole files to two workers in collection order
# (`--no-loadscope-reorder`): the long files start first and the short ones even out the end,
# where sorting by test count (xdist's default) left one worker idle for minutes.
LONG_FILES = ["test_real_model.py", "test_invariance.py", "test_engine_spec.py",
              "test_gemma3.py", "test_experiments.py", "test_docs.py", "test_sharding.py",
              "test_engine_results.py", "test_cached_equals_full.py", "test_hf.py"]


_STALE = [name for name in LONG_FILES if not (Path(__file__).parent / name).is_file()]
assert not _STALE, f"LONG_FILES names files that do not exist: {_STALE}"


# CI requires kvjax's CPU kernel (`.ci/run` sets this): the kernel tests skip where it does
# not build, which on CI would hide a broken C++ build; there the run stops instead
REQUIRE_KERNEL = "KVJAX_REQUIRE_KERNEL"


def pytest_sessionstart(session):
    from kvjax.cpu.product import kernel

    if os.environ.get(REQUIRE_KERNEL) == "1" and not kernel().available:
        pytest.exit(f"{REQUIRE_KERNEL}=1 and kvjax's CPU kernel is not in use: "
                    f"{kernel().describe()}", returncode=1)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """Drops every compiled executable after each test module.

    XLA:CPU maps a few memory regions per compiled executable and never unmaps them while
    the executable is cached; the whole suite compiles thousands, which crossed the
    kernel's `vm.max_map_count` (65530) and crashed inside the compiler (a segfault in
    `backend_compile_and_load`). The persistent cache above makes a program a later module
    shares a load, not a compile: keeping the executables between modules saved 2%.
    """
    yield
    jax.clear_caches()
    from kvjax.decode import aot

    aot.clear()  # the steps' programs kvjax holds by its own key
    gc.collect()


@pytest.fixture
def swapped(monkeypatch):
    """Swaps a name a device loop traces with, `swap(module, name, value)` (the compiled
    code is dropped before and after, so no other test runs a swapped rule; kvjax's kept
    programs are off meanwhile: their key cannot see the swap)."""
    from kvjax.decode import aot, programs

    def drop():
        jax.clear_caches()
        aot.clear()

    def swap(module, name, value):
        monkeypatch.setattr(module, name, value)
        drop()

    with programs.off():
        yield swap
        monkeypatch.undo()
    drop()
