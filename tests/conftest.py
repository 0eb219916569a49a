"""Suite-wide fixtures."""

from __future__ import annotations

import gc

import jax
import pytest


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
