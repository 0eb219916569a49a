"""Suite-wide fixtures, and one XLA compilation cache for the whole test run."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

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


def pytest_unconfigure(config):
    if _OWNER:
        shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """Drops every compiled executable after each test module.

    XLA:CPU maps a few memory regions per compiled executable and never unmaps them while
    the executable is cached; the whole suite compiles thousands, which crossed the
    kernel's `vm.max_map_count` (65530) and crashed inside the compiler (a segfault in
    `backend_compile_and_load`). Modules share few shapes, so little is recompiled.
    """
    yield
    jax.clear_caches()
    gc.collect()
