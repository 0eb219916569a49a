"""`kvjax.decode.programs`: a step's compiled program kept by kvjax's own key. The key
tells apart everything that selects a program; what it cannot key goes through jit; a
broken entry is compiled again. (That a loaded program gives a compile's bits, in another
process: tests/test_compile_cache.py.)"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, params

import kvjax
from kvjax.decode import aot, compile_cache, programs, steps
from kvjax.lab.runner import drop_compiled_code
from kvjax.model.plan import FAST, INVARIANT


def test_the_key_tells_apart_what_selects_a_program():
    a = np.zeros((2, 3), np.int32)
    base = programs.key("extend", {"plan": FAST, "config": CONFIG}, (a,), {"lora": None})
    assert base == programs.key("extend", {"config": CONFIG, "plan": FAST}, (a.copy(),),
                                {"lora": None})
    assert base == programs.key("extend", {"plan": FAST, "config": CONFIG},
                                (jnp.asarray(a),), {"lora": None})
    others = [
        programs.key("decode_loop", {"plan": FAST, "config": CONFIG}, (a,), {"lora": None}),
        programs.key("extend", {"plan": INVARIANT, "config": CONFIG}, (a,), {"lora": None}),
        programs.key("extend", {"plan": FAST, "config": dataclasses.replace(
            CONFIG, d_ff=CONFIG.d_ff * 2)}, (a,), {"lora": None}),
        programs.key("extend", {"plan": FAST, "config": CONFIG}, (a[:1],), {"lora": None}),
        programs.key("extend", {"plan": FAST, "config": CONFIG}, (a.astype(np.float32),),
                     {"lora": None}),
        programs.key("extend", {"plan": FAST, "config": CONFIG}, (a,), {"lora": a}),
        programs.key("extend", {"plan": FAST, "config": CONFIG}, (a,), {}),
        programs.key("extend", {"plan": FAST, "config": CONFIG}, (), {"x": a, "lora": None}),
        programs.key("extend", {"plan": FAST, "config": CONFIG}, (jnp.int32(0),),
                     {"lora": None}),
    ]
    assert len({base, *others}) == len(others) + 1
    weak = programs.key("f", {}, (1,), {})  # a Python scalar is weakly typed
    assert weak != programs.key("f", {}, (np.int32(1),), {})


def test_the_environment_names_every_source_file(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "k.cc").write_text("int f();\n")
    first = compile_cache.source_digest(tmp_path)
    (tmp_path / "k.cc").write_text("int g();\n")
    second = compile_cache.source_digest(tmp_path)
    (tmp_path / "b.py").write_text("")
    assert len({first, second, compile_cache.source_digest(tmp_path)}) == 3


def test_what_it_cannot_key_goes_through_jit():
    @dataclasses.dataclass
    class Loose:  # not frozen: its value may change after it keyed a program
        n: int = 1

    for value in (Loose(), object(), {1: Loose()}):
        with pytest.raises(programs.Unkeyed):
            programs.plain(value)
    assert programs.plain((1, "a", None, 2.5)) == programs.plain((1, "a", None, 2.5))
    assert programs.plain(1) != programs.plain(True) != programs.plain(1.0)


def test_a_broken_entry_is_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setattr(programs, "folder", lambda: tmp_path)
    logits = np.arange(12, dtype=np.float32).reshape(3, 4)
    want = np.asarray(steps.greedy(logits))
    entry = tmp_path / f"test_greedy-{programs.key('test_greedy', {}, (logits,), {})[:48]}"
    entry.write_bytes(b"cut short")
    assert programs.load(entry) is None and not entry.exists()  # removed
    entry.write_bytes(b"cut short")
    sampler = aot.Program(steps.greedy, "test_greedy")  # a new process's step
    before = aot.trace_counts().get("test_greedy", 0)
    np.testing.assert_array_equal(sampler(logits), want)
    assert aot.trace_counts()["test_greedy"] == before + 1
    # compiled again; kept anew unless JAX's cache handed the program back (programs.serialized)
    assert not entry.exists() or entry.read_bytes() != b"cut short"


def test_a_sweep_drops_the_programs_the_steps_hold(monkeypatch):
    monkeypatch.setenv(programs.SWITCH, "1")
    kvjax.generate(params(), CONFIG, [[1, 2, 3]], 2, cache=CACHE)
    assert any(p.loaded for p in aot._PROGRAMS)
    drop_compiled_code()
    assert not any(p.loaded for p in aot._PROGRAMS)


def test_the_key_names_jax_s_options():
    """A program compiled under another option (level 0 optimizations here, which breaks
    invariance: tests/test_tiled.py) is another program; a cache or log option is not."""
    a = np.zeros(3, np.float32)
    base = programs.key("f", {}, (a,), {})
    was = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", not was)
    try:
        other = programs.key("f", {}, (a,), {})
    finally:
        jax.config.update("jax_disable_most_optimizations", was)
    assert other != base
    logged = jax.config.values["jax_log_compiles"]
    jax.config.update("jax_log_compiles", not logged)
    try:
        assert programs.key("f", {}, (a,), {}) == base
    finally:
        jax.config.update("jax_log_compiles", logged)


_GREEDY = aot.Program(steps.greedy, "test_thread_greedy")


def test_compile_only_is_the_calling_thread_s():
    """A warm-up in one thread leaves the steps of another running for real."""
    import threading

    logits = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = {}

    def other():
        got["tokens"] = np.asarray(_GREEDY(logits))

    with aot.compiling():
        assert np.all(np.asarray(_GREEDY(logits)) == 0)  # a placeholder
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    np.testing.assert_array_equal(got["tokens"], [3, 3, 3])


def test_the_kept_programs_follow_the_opt_out():
    """`KVJAX_XLA_CACHE=0` turns kvjax's store off even beside the user's own JAX cache
    (this run's, tests/conftest.py), and a remote JAX cache folder keeps nothing."""
    assert compile_cache.current(kept=True, environ={}) is not None
    assert compile_cache.current(kept=True, environ={compile_cache.ENV_VAR: "0"}) is None
    own = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", "gs://bucket/cache")
    try:
        assert compile_cache.current(kept=True, environ={}) is None
    finally:
        jax.config.update("jax_compilation_cache_dir", own)
