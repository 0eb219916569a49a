"""Compiled programs kept across processes (`kvjax.decode.compile_cache`): where the cache lives,
who switches it on, that a program loaded from it gives the bits a compile gives, and that
the cache folder and the C++ kernel cache stay bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, params

from kvjax import Engine, EngineConfig
from kvjax.cpu.build import STALE_DAYS, drop_stale
from kvjax.decode import compile_cache
from kvjax.decode import generate as generate_module

ROOT = Path(__file__).resolve().parents[1]

# Two fresh processes run the same invariant generate with logits under one cache folder;
# each prints what its compiles asked of the cache and where the cache was.
CHILD = """
import json, sys
import jax, numpy as np
import kvjax
from kvjax.model.plan import INVARIANT
assert jax.config.jax_compilation_cache_dir is None, "import kvjax switched the cache on"
counts = {"requests": 0, "hits": 0, "kept": 0, "compiled": 0}
EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
          "/jax/compilation_cache/cache_hits": "hits", "/kvjax/programs/loaded": "kept",
          "/kvjax/programs/compiled": "compiled"}
jax.monitoring.register_event_listener(
    lambda event, **_: EVENTS.get(event) and counts.__setitem__(
        EVENTS[event], counts[EVENTS[event]] + 1))
config = kvjax.ModelConfig(vocab_size=61, num_layers=2, d_model=32, num_heads=4,
                           num_kv_heads=2, d_ff=64, max_seq_len=128)
params = kvjax.init_params(config, seed=1)
counts.update(requests=0, hits=0, kept=0, compiled=0)  # generate's, with the cache it switches on
out = kvjax.generate(params, config, [[5, 9, 2, 44, 17, 3, 8], [1, 2, 3]], 6,
                     return_logits=True, plan=INVARIANT)
np.savez(sys.argv[1], *out.logits, tokens=np.asarray(out.tokens))
print(json.dumps(counts | {"dir": jax.config.jax_compilation_cache_dir}))
"""


def _child(tmp_path: Path, name: str) -> tuple[dict, dict]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", compile_cache.ENV_VAR)}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    env["KVJAX_KEEP_PROGRAMS"] = "1"  # kvjax's kept steps beside JAX's (a user's default)
    out = tmp_path / f"{name}.npz"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    with np.load(out) as saved:
        return counts, {key: saved[key] for key in saved.files}


def test_a_program_loaded_from_the_cache_gives_the_bits_a_compile_gives(tmp_path):
    """The first process compiles every program (none in the cache: its folder under
    XDG_CACHE_HOME, made by `generate`, not by the import) and writes them; the second
    loads every program it asks for (the steps by kvjax's own key, untraced: `kept`; the
    rest from JAX's cache) and gets the first's tokens and logits bitwise."""
    first, want = _child(tmp_path, "first")
    second, got = _child(tmp_path, "second")
    folder = compile_cache.host_folder(tmp_path / "xdg" / "kvjax" / "xla") / \
        compile_cache.version()
    assert first["dir"] == second["dir"] == str(folder)
    assert first["requests"] > 0 and first["hits"] == first["kept"] == 0
    assert first["compiled"] >= 3  # extend, decode_loop and the first tokens' sampler
    assert second["kept"] == first["compiled"] and second["compiled"] == 0
    # JAX counts a request for every compile, kvjax's kept ones too (not cached by JAX)
    assert second["requests"] + second["kept"] == first["requests"]
    assert second["hits"] == second["requests"]
    assert len(list((folder / "programs").iterdir())) == second["kept"]
    assert len(list(folder.iterdir())) >= first["requests"]
    assert want.keys() == got.keys() and len(want) == 3
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])


# One step, the first program its process compiles, in a fresh process: prints how many
# steps the process kept, read from kvjax's store, and the step's result.
STEP_CHILD = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from kvjax.decode import aot, compile_cache
counts = {"kept": 0, "loaded": 0}
EVENTS = {"/kvjax/programs/compiled": "kept", "/kvjax/programs/loaded": "loaded"}
jax.monitoring.register_event_listener(
    lambda event, **_: EVENTS.get(event) and counts.__setitem__(
        EVENTS[event], counts[EVENTS[event]] + 1))
compile_cache.enable()
step = aot.Program(lambda x: jnp.exp(-x * x).sum(-1) + jnp.tanh(x).max(-1), "child_step")
x = np.linspace(-2, 2, 48, dtype=np.float32).reshape(6, 8)
print(json.dumps(counts | {"out": np.asarray(step(x)).tolist()}))
"""


def _step_child(cache: Path, keep: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update({compile_cache.ENV_VAR: str(cache), "KVJAX_KEEP_PROGRAMS": keep})
    proc = subprocess.run([sys.executable, "-c", STEP_CHILD], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_step_jax_s_cache_handed_back_is_kept_from_the_bytes_jax_read(tmp_path):
    """XLA:CPU writes a program's machine code into its copy only in the process that
    compiled it: a step JAX's cache gave back, re-serialized, would be kept without its
    kernels and fail where it is loaded ("Function ... not found"). So kvjax keeps it from
    the bytes JAX read (`programs.handed_back`). A process with kvjax's store off fills
    JAX's cache; the next, store on, gets the step from JAX's cache and keeps it; the one
    after reads it from kvjax's store (untraced), the same bits. Control: in an empty
    folder the step is compiled, kept, and read back by the next process."""
    jax_only = _step_child(tmp_path / "a", "0")
    after_jax = _step_child(tmp_path / "a", "1")
    assert jax_only["kept"] == after_jax["loaded"] == 0 and after_jax["kept"] == 1
    store = compile_cache.host_folder(tmp_path / "a") / compile_cache.version() / "programs"
    assert len(list(store.iterdir())) == 1
    again = _step_child(tmp_path / "a", "1")
    assert again["loaded"] == 1 and again["kept"] == 0
    fresh = _step_child(tmp_path / "b", "1")
    loaded = _step_child(tmp_path / "b", "1")
    assert fresh["kept"] == 1 and loaded["loaded"] == 1 and loaded["kept"] == 0
    for other in (after_jax, again, fresh, loaded):
        assert other["out"] == jax_only["out"]


def test_the_folder_is_the_user_s_cache_folder_unless_switched_off():
    """Under the user's cache folder (XDG's when absolute) or the named one, in the CPU's
    own subfolder (a digest of its model and flags, which JAX's keys do not name), then
    this kvjax's (a digest of its source)."""
    home, cpu = Path.home(), compile_cache.host_folder(Path("/")).name
    here = Path(cpu, compile_cache.version())
    assert len(cpu) == 12 and len(here.name) == 12
    assert compile_cache.folder({}) == home / ".cache/kvjax/xla" / here
    assert compile_cache.folder({"XDG_CACHE_HOME": "/x/cache"}) == Path("/x/cache/kvjax/xla",
                                                                         here)
    assert compile_cache.folder({"XDG_CACHE_HOME": "rel"}) == home / ".cache/kvjax/xla" / here
    assert compile_cache.folder({compile_cache.ENV_VAR: "/y"}) == Path("/y", here)
    assert compile_cache.folder({compile_cache.ENV_VAR: "0"}) is None


def test_another_kvjax_s_folder_is_dropped_when_unused(tmp_path):
    """Each kvjax source has its own folder; one unused for `STALE_DAYS` goes when another
    kvjax switches the cache on."""
    old = time.time() - (compile_cache.STALE_DAYS + 1) * 86400
    mine, recent, stale = (tmp_path / name for name in ("mine", "recent", "stale"))
    for folder in (mine, recent, stale):
        (folder / "programs").mkdir(parents=True)
        (folder / "programs" / "entry").write_bytes(b"x")
    for path in (stale / "programs" / "entry", stale / "programs", stale):
        os.utime(path, (old, old))
    assert compile_cache.drop_versions(mine, compile_cache.STALE_DAYS) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "recent"]


def test_another_cpu_has_another_folder(monkeypatch):
    from kvjax.cpu import build

    here = compile_cache.host_folder(Path("/c"))
    monkeypatch.setattr(compile_cache, "cpu_features",
                        lambda: build.cpu_features() + " amx_tile")
    assert compile_cache.host_folder(Path("/c")) != here


def test_a_user_s_own_jax_cache_is_left_as_configured(monkeypatch, tmp_path):
    """This run configured JAX's cache itself (tests/conftest.py): enabling keeps its
    folder, whatever kvjax's variables say, and creates nothing of its own."""
    own = jax.config.jax_compilation_cache_dir
    assert own
    monkeypatch.setattr(compile_cache, "_enabled", [])
    assert compile_cache.enable({compile_cache.ENV_VAR: str(tmp_path)}) == Path(own)
    assert jax.config.jax_compilation_cache_dir == own
    assert not any(tmp_path.iterdir())


def test_the_entry_points_switch_the_cache_on(monkeypatch):
    """Engine, generate and the kvjax command (every command but the memory calculator)."""
    from kvjax import cli

    calls = []
    monkeypatch.setattr(compile_cache, "enable", lambda *a: calls.append("on"))
    Engine(params(), CONFIG, EngineConfig(cache=CACHE))
    assert calls == ["on"]
    generate_module.generate(params(), CONFIG, [[1, 2, 3]], 1)
    assert calls == ["on", "on"]
    monkeypatch.setattr(cli, "_generate", lambda args: 0)
    assert cli.main(["generate", "configs/tiny.toml"]) == 0
    assert calls == ["on", "on", "on"]
    assert cli.main(["memory"]) == 0
    assert calls == ["on", "on", "on"]


def test_an_oversized_cache_drops_its_oldest_entries(tmp_path):
    """Over the bound, the entries written longest ago go until half the bound is left."""
    now = time.time()
    for i in range(10):  # entry i: 100 bytes, written i hours before now
        path = tmp_path / f"entry{i}"
        path.write_bytes(b"x" * 100)
        os.utime(path, (now - 3600 * i, now - 3600 * i))
    assert compile_cache.prune(tmp_path, 1000) == []  # at the bound: nothing
    gone = compile_cache.prune(tmp_path, 900)
    assert sorted(p.name for p in gone) == [f"entry{i}" for i in range(4, 10)]  # 400 left
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"entry{i}" for i in range(4)]


def test_a_new_kernel_build_drops_stale_builds(tmp_path):
    """Libraries other than the new one unused for STALE_DAYS and temporary files of
    builds over a day old go; recent libraries and a build in progress stay."""
    now = time.time()
    ages = {"kvjax_cpu-new.so": STALE_DAYS * 2, "kvjax_cpu-old.so": STALE_DAYS + 1,
            "kvjax_cpu-recent.so": STALE_DAYS - 1, "tmpdead.so": 2, "tmplive.so": 0.5,
            "other.so": STALE_DAYS * 2}
    for name, days in ages.items():
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, (now - days * 86400, now - days * 86400))
    gone = drop_stale(tmp_path, tmp_path / "kvjax_cpu-new.so", now)
    assert sorted(p.name for p in gone) == ["kvjax_cpu-old.so", "tmpdead.so"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "kvjax_cpu-new.so", "kvjax_cpu-recent.so", "other.so", "tmplive.so"]


def test_the_opt_out_leaves_jax_untouched(tmp_path):
    """KVJAX_XLA_CACHE=0: an engine's process compiles with no cache folder."""
    code = ("import jax, kvjax\nfrom kvjax.decode import compile_cache\n"
            "assert compile_cache.enable() is None\n"
            "assert jax.config.jax_compilation_cache_dir is None\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update({compile_cache.ENV_VAR: "0", "XDG_CACHE_HOME": str(tmp_path)})
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not any(tmp_path.iterdir())


def test_a_bound_that_is_no_whole_number_of_bytes_is_named():
    assert compile_cache.max_bytes({}) == compile_cache.MAX_BYTES
    assert compile_cache.max_bytes({"KVJAX_XLA_CACHE_BYTES": "1000"}) == 1000
    for bad in ("4G", "-3", "1.5"):
        with pytest.raises(ValueError, match="KVJAX_XLA_CACHE_BYTES='"):
            compile_cache.max_bytes({"KVJAX_XLA_CACHE_BYTES": bad})
