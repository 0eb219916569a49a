"""Start-up probe results kept on disk (`kvjax.model.probe_cache`): read back by a later
call without probing, keyed by the environment and by the probe's own code, off with
KVJAX_PROBE_CACHE=0, and a broken file costs a probe, not an error."""

from __future__ import annotations

import importlib
import json
import sys

import jax

from kvjax.model import lora, probe_cache, tiled


def _counted(calls: list):
    def probe(shape, n):
        calls.append(n)
        return n > 2
    return probe_cache.persistent(probe)


def test_a_result_is_read_back_and_keyed_by_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "probes.json"
    monkeypatch.setenv("KVJAX_PROBE_CACHE", str(path))
    calls = []
    probe = _counted(calls)
    assert probe((4, 8), 3) is True and probe((4, 8), 1) is False
    assert probe((4, 8), 3) is True and probe((4, 8), 1) is False  # from the file
    assert calls == [3, 1] and len(json.loads(path.read_text())) == 2
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")  # another backend
    assert probe((4, 8), 3) is True
    assert calls == [3, 1, 3]
    jax.config.update("jax_disable_most_optimizations", True)  # another compiler setting
    try:
        assert probe((4, 8), 3) is True
    finally:
        jax.config.update("jax_disable_most_optimizations", False)
    assert calls == [3, 1, 3, 3]


def test_an_edited_probe_module_probes_again(tmp_path, monkeypatch):
    """A result found by older code is not read back: the key holds a digest of the source
    of the module that defines the probe."""
    monkeypatch.setenv("KVJAX_PROBE_CACHE", str(tmp_path / "probes.json"))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "edited_probe.py"
    source = ("from kvjax.model import probe_cache\nCALLS = []\n\n"
              "@probe_cache.persistent\ndef probe(n):\n    CALLS.append(n)\n    return {}\n")
    module.write_text(source.format("True"))
    mod = importlib.import_module("edited_probe")
    assert mod.probe(3) is True and mod.probe(3) is True and mod.CALLS == [3]
    module.write_text(source.format("False"))  # the probe now finds otherwise
    probe_cache.code_digest.cache_clear()
    mod = importlib.reload(mod)
    assert mod.probe(3) is False and mod.CALLS == [3]
    sys.modules.pop("edited_probe")
    probe_cache.code_digest.cache_clear()


def test_an_edited_sibling_of_the_probe_module_probes_again(tmp_path, monkeypatch):
    """The digest covers every module of the probe's package, not only the probe's own: a
    probe runs code beside it (`kvjax.model.tiled`'s probes run `layout`'s views, `lora`'s
    run `tiled`'s blocks), so an edit there, the probe's file untouched, probes again."""
    monkeypatch.setenv("KVJAX_PROBE_CACHE", str(tmp_path / "probes.json"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # the reload reads the new source
    package = tmp_path / "probed_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    probe_file = package / "probes.py"
    probe_file.write_text("from kvjax.model import probe_cache\n"
                          "from probed_package import helper\nCALLS = []\n\n"
                          "@probe_cache.persistent\ndef probe(n):\n    CALLS.append(n)\n"
                          "    return helper.answer(n)\n")
    helper = package / "helper.py"
    helper.write_text("def answer(n):\n    return n > 2\n")
    names = ("probed_package", "probed_package.probes", "probed_package.helper")
    try:
        probes = importlib.import_module("probed_package.probes")
        assert probes.probe(3) is True and probes.probe(3) is True and probes.CALLS == [3]
        source = probe_file.read_bytes()
        helper.write_text("def answer(n):\n    return n > 5\n")  # now finds otherwise
        probe_cache.code_digest.cache_clear()  # as a later process would start
        importlib.reload(sys.modules["probed_package.helper"])
        assert probes.probe(3) is False and probes.CALLS == [3, 3]  # probed, not read back
        assert probe_file.read_bytes() == source
    finally:
        for name in names:
            sys.modules.pop(name, None)
        probe_cache.code_digest.cache_clear()
    # the engine's probes: one digest for every module of kvjax.model
    assert probe_cache.code_digest("kvjax.model.tiled") == probe_cache.code_digest(
        "kvjax.model.layout") == probe_cache.code_digest(lora.__name__)


def test_off_and_broken_files(tmp_path, monkeypatch):
    monkeypatch.setenv("KVJAX_PROBE_CACHE", "0")
    calls = []
    probe = _counted(calls)
    probe((4,), 3)
    probe((4,), 3)
    assert calls == [3, 3]
    path = tmp_path / "probes.json"
    path.write_text("{not json")
    monkeypatch.setenv("KVJAX_PROBE_CACHE", str(path))
    assert probe((4,), 3) is True and calls == [3, 3, 3]
    assert len(json.loads(path.read_text())) == 1  # rewritten whole


def test_the_engine_probes_go_through_the_file(tmp_path, monkeypatch):
    """A row probe's answer is stored; a later process (here: the in-process cache
    cleared) reads it instead of probing."""
    monkeypatch.setenv("KVJAX_PROBE_CACHE", str(tmp_path / "probes.json"))
    tiled._probe_whole.cache_clear()
    args = ((64, 96), (0,), 33, jax.default_backend())
    answer = tiled._probe_whole(*args)
    tiled._probe_whole.cache_clear()

    def no_probe(*a, **k):
        raise AssertionError("probed again")

    monkeypatch.setattr(tiled, "_rows_agree", no_probe)
    assert tiled._probe_whole(*args) == answer
    tiled._probe_whole.cache_clear()
