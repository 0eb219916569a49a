"""Suite-wide fixtures, and one XLA compilation cache for the whole test run."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path

import jax
import pytest

# Test modules compile many of the same programs (the engine tests share one model and cache
# shape) and every module drops its compiled code (below). A persistent compilation cache for
# the run turns those recompilations into loads of the same executables (the same binary, so
# every bitwise comparison holds as before): 8 min 24 s instead of 9 min 2 s on two cores.
# The first process to load this file (pytest itself, or the xdist controller) makes the
# folder; the workers it starts inherit its path; pytest_unconfigure removes it.
_CACHE_ENV = "KVJAX_TEST_XLA_CACHE"
if _CACHE_ENV not in os.environ:
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="kvjax-test-xla-")
    _OWNER = True
else:
    _OWNER = False
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The host's CPU and vector instruction sets after the failures (and under -q): XLA and
    kvjax's C++ pick kernels by them, so a bitwise failure reads with its host."""
    from kvjax.backend import host_cpu

    terminalreporter.write_line(f"host CPU: {host_cpu()}")


def pytest_unconfigure(config):
    if _OWNER:
        shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


# Files that take a minute or more of one worker, longest first (`--durations` on two
# cores). `scripts/test` hands whole files to two workers in collection order
# (`--no-loadscope-reorder`): the long files start first and the short ones even out the end,
# where sorting by test count (xdist's default) left one worker idle for minutes.
LONG_FILES = ["test_real_model.py", "test_invariance.py", "test_engine_spec.py",
              "test_gemma3.py", "test_experiments.py", "test_docs.py", "test_sharding.py",
              "test_engine_results.py", "test_cached_equals_full.py", "test_hf.py"]


_STALE = [name for name in LONG_FILES if not (Path(__file__).parent / name).is_file()]
assert not _STALE, f"LONG_FILES names files that do not exist: {_STALE}"


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
    gc.collect()


@pytest.fixture
def swapped(monkeypatch):
    """Swaps a name a device loop traces with, `swap(module, name, value)` (the compiled
    code is dropped before and after, so no other test runs a swapped rule)."""
    def swap(module, name, value):
        monkeypatch.setattr(module, name, value)
        jax.clear_caches()

    yield swap
    monkeypatch.undo()
    jax.clear_caches()
