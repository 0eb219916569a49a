"""Compiled steps kept by kvjax's own key: a new process runs a step's program without
tracing or lowering it.

JAX's persistent cache (`kvjax.decode.compile_cache`) finds a program by its lowered HLO, so
a process traces and lowers every step before it can load it: for SmolLM2 most of a warm
start. The steps kvjax wraps (`kvjax.decode.aot.Program`) are also kept by what selects
their program, known before any tracing:

- the step's name and its static arguments' values (plain values and frozen dataclasses
  of them: a model config, a numerics plan);
- each array argument's shape, dtype and weak type, and the arguments' tree structure;
- kvjax's source (a digest of every file of the package), jax's and jaxlib's versions, the
  backend and device kind, `XLA_FLAGS` and JAX's options (all but caches' and logs'); the
  CPU through the folder (`compile_cache`'s per-CPU folder, `programs/`).

A hit deserializes the executable XLA compiled (`jax.experimental.serialize_executable`):
the same program, the same bits (`tests/test_compile_cache.py` compares a fresh compile
with a load in another process, bitwise). Kept only in a process of its own, where every
argument lives on one device and every static argument is plain; otherwise, with the
cache switched off (`KVJAX_XLA_CACHE=0`) and with `KVJAX_KEEP_PROGRAMS=0`, the step is
jit's as before. Only a program whose copy holds its machine code is kept (`serialized`):
one compiled here, or one JAX's persistent cache handed back, kept from the bytes JAX read
(`handed_back`: the copy its compile wrote), so a step traced once over a warm JAX cache
is not traced again.
An entry that cannot be read is compiled again and rewritten. The key cannot see code
patched at run time: a test that swaps a rule a step traces runs under `off()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import io
import os
import pickle
import threading
import zlib
from importlib import metadata
from pathlib import Path

import jax
import numpy as np
from jax._src import compilation_cache as jax_cache
from jax._src.lib import xla_client
from jax.experimental import serialize_executable

from kvjax.backend import STARTED_BEFORE_FLAGS
from kvjax.cpu.build import cpu_features
from kvjax.decode import compile_cache

FOLDER = "programs"
SWITCH = "KVJAX_KEEP_PROGRAMS"  # "0": steps are jit's alone
COMPILED = "/kvjax/programs/compiled"  # a step's program compiled and kept here
ELF = b"\x7fELF"  # the start of an object file: XLA:CPU's machine code in a program's copy
# the packages a step's program depends on beside kvjax (tracing goes through flax)
_PACKAGES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes")
# JAX options that never change a program (caches, logs, dumps): every other is keyed
_IGNORED = ("compilation_cache", "persistent_cache", "log", "dump", "traceback", "explain",
            "pprint", "source_url", "check_proxy", "timeout")
_ENVIRONMENT: list[str] = []
_OFF = threading.local()  # .on: off() in this thread
_HANDED = threading.local()  # .got: where handed_back() collects, in this thread
_WATCH = threading.Lock()


class Unkeyed(Exception):
    """An argument kvjax does not key (a mesh, an unknown object): jit's path instead."""


def folder() -> Path | None:
    """Where the programs are kept: `programs/` of the folder JAX caches in (kvjax's per-CPU
    one once an entry point switched it on, or the user's own); None when
    `KVJAX_KEEP_PROGRAMS=0` (`SWITCH`), in a process of several devices, or the process is
    one of several (a program of a multi-process run is its run's), or JAX's backend
    started before kvjax set XLA's flags (`kvjax.backend.STARTED_BEFORE_FLAGS`)."""
    if (os.environ.get(SWITCH) == "0" or getattr(_OFF, "on", False) or STARTED_BEFORE_FLAGS
            or jax.process_count() > 1 or jax.device_count() > 1):
        return None
    base = compile_cache.current(kept=True)
    return None if base is None else base / FOLDER


@contextlib.contextmanager
def off():
    """Within it the steps are jit's alone: for code that swaps what a step traces (a
    patched rule), which kvjax's key cannot see. Drop the steps' programs around it
    (`kvjax.decode.aot.clear`, `jax.clear_caches`)."""
    was, _OFF.on = getattr(_OFF, "on", False), True
    try:
        yield
    finally:
        _OFF.on = was


def environment() -> str:
    """The digest of what every program depends on beside its arguments (once a process)."""
    if not _ENVIRONMENT:
        h = hashlib.sha256(compile_cache.version().encode())
        device = jax.devices()[0]
        versions = [f"{m}={metadata.version(m)}" for m in _PACKAGES]
        h.update("\0".join([*versions, jax.default_backend(), device.device_kind,
                            getattr(device, "platform_version", ""), cpu_features(),
                            os.environ.get("XLA_FLAGS", "")]).encode())
        _ENVIRONMENT.append(h.hexdigest())
    return _ENVIRONMENT[0]


def options() -> str:
    """JAX's options now, but those that never change a program (read at every key: a
    process may change them, `jax_disable_most_optimizations` one)."""
    return ";".join(f"{name}={value!r}" for name, value in sorted(jax.config.values.items())
                    if not any(part in name for part in _IGNORED))


def plain(value) -> str:
    """A static argument's canonical text; raises Unkeyed for anything else."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({','.join(plain(v) for v in value)})"
    if isinstance(value, dict):
        return "dict(" + ",".join(f"{plain(k)}:{plain(v)}" for k, v in
                                  sorted(value.items(), key=lambda kv: repr(kv[0]))) + ")"
    if isinstance(value, np.dtype):
        return f"dtype:{value}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if not type(value).__dataclass_params__.frozen:
            raise Unkeyed(type(value).__qualname__)
        fields = ",".join(f"{f.name}={plain(getattr(value, f.name))}"
                          for f in dataclasses.fields(value))
        return f"{type(value).__module__}.{type(value).__qualname__}({fields})"
    raise Unkeyed(type(value).__qualname__)


def leaf(x) -> str:
    """An array argument's shape, dtype, weak type and device (when not the default one, a
    NumPy array's); raises Unkeyed for arrays spread over devices."""
    where = ""
    if isinstance(x, jax.Array):
        devices = x.sharding.device_set
        if len(devices) != 1:
            raise Unkeyed("an array over several devices")
        device = next(iter(devices))
        where = "" if device == jax.devices()[0] else f"@{device}"
    aval = jax.typeof(x)
    return f"{aval.dtype}{list(aval.shape)}{'w' if aval.weak_type else ''}{where}"


def key(name: str, statics: dict, args: tuple, kwargs: dict) -> str:
    """The program's key (module docstring): `statics` by name, the dynamic arguments as
    the step is called with them."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    text = "\n".join([name, environment(), options(), str(tree), ";".join(map(leaf, leaves)),
                      *(f"{k}={plain(v)}" for k, v in sorted(statics.items()))])
    return hashlib.sha256(text.encode()).hexdigest()


def _read(blob: bytes):
    """JAX's reading of a cache entry (executable bytes, compile time), watched: the bytes go
    to this thread's `handed_back` list."""
    executable, seconds = _EXTRACT[0](blob)
    got = getattr(_HANDED, "got", None)
    if got is not None:
        got.append(executable)
    return executable, seconds


_EXTRACT: list = []  # JAX's own reader, once watched


@contextlib.contextmanager
def handed_back():
    """Within it, a program JAX's persistent cache hands back in this thread leaves the bytes
    JAX read (the executable as its compile serialized it, machine code within) in the
    yielded list. JAX reads an entry through `compilation_cache.extract_executable_and_time`
    (jax 0.10): kvjax watches that function, and where a JAX lacks it nothing is collected
    (such a step is then not kept, as before)."""
    with _WATCH:
        reader = getattr(jax_cache, "extract_executable_and_time", None)
        if reader is not None and not _EXTRACT:
            _EXTRACT.append(reader)
            jax_cache.extract_executable_and_time = _read
    got: list[bytes] = []
    _HANDED.got = got
    try:
        yield got
    finally:
        _HANDED.got = None


class _WithCode(serialize_executable._JaxPjrtPickler):
    """JAX's pickler of a compiled program, with the executable's bytes given (`code`, what
    JAX's cache read) in place of XLA's re-serialization of it."""

    def __init__(self, file, code: bytes):
        super().__init__(file)
        self.code = code

    def persistent_id(self, obj):
        if isinstance(obj, xla_client.LoadedExecutable):
            return ("exec", self.code)
        return super().persistent_id(obj)


def _serialize(program, code: bytes | None) -> tuple:
    """`serialize_executable.serialize(program)`, the executable's bytes `code` when given."""
    if code is None:
        return serialize_executable.serialize(program)
    unloaded = program._executable._unloaded_executable
    args, in_tree = jax.tree.flatten(program.args_info)
    with io.BytesIO() as file:
        _WithCode(file, code).dump((unloaded, args, program._no_kwargs))
        return file.getvalue(), in_tree, program.out_tree


def serialized(program, code: bytes | None = None) -> bytes | None:
    """A compiled program's copy to keep, or None where it would not run elsewhere; `code`:
    the executable's bytes as JAX's cache handed them back (`handed_back`).

    XLA:CPU writes a program's machine code (its kernels' object files) into the copy only
    when this process compiled it: a program JAX's persistent cache handed back (or one
    read from here) serializes without them, and its copy fails where it is loaded
    ("Function ... not found"). JAX's cache gives back any program it holds however its
    options are set once a process has used it: such a program is kept from the bytes JAX
    read (`code`, written by the compile), never from XLA's re-serialization; a CPU copy
    that holds no object file is not kept (next time the step is compiled, or read from
    JAX's cache, again). Checked by tests/test_compile_cache.py, in processes."""
    try:
        blob = pickle.dumps(_serialize(program, code))
    except Exception:  # a program that does not serialize is compiled again next time
        return None
    if jax.default_backend() == "cpu" and ELF not in blob:
        return None
    return blob


def load(path: Path):
    """The compiled program kept at `path`, or None (none kept, or unreadable: removed)."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        executable, in_tree, out_tree = pickle.loads(zlib.decompress(blob))
        program = serialize_executable.deserialize_and_load(executable, in_tree, out_tree)
    except Exception:  # a cut-short or foreign entry: compile again
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # last use, for `compile_cache.prune`
    return program


def save(path: Path, program, code: bytes | None = None) -> bool:
    """Keeps a compiled program at `path` (written whole, then renamed into place) where
    its copy is whole (`serialized`; `code` as it takes it); a folder that cannot be
    written costs a compile next time, not a failure. Whether it was kept."""
    blob = serialized(program, code)
    if blob is None:
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.part")
        part.write_bytes(zlib.compress(blob, 1))  # a quarter of the bytes, ~3 ms
        part.replace(path)
    except OSError:
        return False
    jax.monitoring.record_event(COMPILED)
    return True
