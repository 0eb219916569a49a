"""What kvjax asks of the XLA backend before JAX starts it: plain Python, no JAX.

Invariant numerics (`EngineConfig.numerics`) need every elementwise operation to round the
same way whatever the shape of the array it runs on. XLA CPU's fusion emitters (the default
in jax 0.10) do not: inside the on-device decode loop a token's layer-0 keys differed in the
last bit (6e-8) between a batch of one row and of two, while every product, norm and
rotation agreed when checked alone; with `--xla_cpu_use_fusion_emitters=false` every one
of the engine's knobs left a request's logits bitwise unchanged, with decode and prefill
speed on the bench model unchanged within noise (docs/benchmarks.md).

So importing kvjax adds that flag to `XLA_FLAGS` unless the flag is already there (either
value: the user's choice stands) or `KVJAX_XLA_FLAGS=0`. XLA reads the variable when JAX
creates its CPU client, at the first computation: a program that computed something before
importing kvjax keeps its flags, and the engine's start-up check (`kvjax.model.tiled`) says
so. jaxlib aborts on a flag it does not know, so the flag is only added for the jaxlib
versions it was checked on.

XLA's backend optimization level 0 (`--xla_backend_optimization_level=0`, or JAX's
`jax_disable_most_optimizations`, which sets it) breaks invariance too: a prompt's
prefill logits alone and beside another prompt differed by up to 2.4e-6 under the invariant
plan (levels 1 and 2 and the default keep them equal; docs/numerics.md). kvjax does not
change that setting; `optimization_off` says when it is set, and the engine's start-up check
names it.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

FUSION_FLAG = "--xla_cpu_use_fusion_emitters"
LEVEL_FLAG = "--xla_backend_optimization_level"
CHECKED_JAXLIB = ("0.10.",)  # jaxlib versions known to accept FUSION_FLAG


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return ""


def set_xla_flags(environ=os.environ) -> bool:
    """Adds `FUSION_FLAG=false` to XLA_FLAGS where allowed (see the module docstring);
    returns whether the flag is now false in `environ`."""
    flags = environ.get("XLA_FLAGS", "")
    if FUSION_FLAG not in flags and environ.get("KVJAX_XLA_FLAGS", "1") != "0" \
            and _jaxlib_version().startswith(CHECKED_JAXLIB):
        environ["XLA_FLAGS"] = f"{flags} {FUSION_FLAG}=false".strip()
    return fusion_emitters_off(environ)


def _flag(name: str, environ) -> str | None:
    """The value XLA_FLAGS gives flag `name` (the last setting wins), lower case, or None."""
    value = None
    for flag in environ.get("XLA_FLAGS", "").split():
        if flag.startswith(name + "="):
            value = flag.split("=", 1)[1].lower()
    return value


def fusion_emitters_off(environ=os.environ) -> bool:
    """Whether XLA_FLAGS turns XLA CPU's fusion emitters off."""
    return _flag(FUSION_FLAG, environ) in ("false", "0")


def optimization_off(environ=os.environ, disable_most: bool = False) -> bool:
    """Whether XLA compiles at backend optimization level 0: XLA_FLAGS says so, or JAX's
    `jax_disable_most_optimizations` (the caller passes its value: this module has no JAX)."""
    return disable_most or _flag(LEVEL_FLAG, environ) == "0"


def cache_home(environ=os.environ) -> Path:
    """kvjax's folder in the user's cache folder: `$XDG_CACHE_HOME/kvjax`, else
    `~/.cache/kvjax` (the XDG base directory convention). Compiled programs, probe results
    and the CPU kernel are kept there (docs/engine.md)."""
    base = environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "kvjax"


# the /proc/cpuinfo flags that decide which vector kernels XLA, oneDNN or kvjax's C++ picks
VECTOR_FLAGS = ("sse4_2", "avx", "fma", "f16c", "amx", "vnni", "bf16", "fp16", "asimd", "sve")


def host_cpu(cpuinfo: str | None = None) -> str:
    """The CPU's model, core count and vector instruction sets, in one line (a product's
    bits can depend on them: the suite prints it so a failure reads with its host)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            import platform

            return f"{platform.machine()} {platform.processor()}".strip()
    fields = {}
    for line in cpuinfo.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = [f for f in (fields.get("flags") or fields.get("Features") or "").split()
             if f.startswith(VECTOR_FLAGS)]
    model = fields.get("model name") or fields.get("CPU part") or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores; {' '.join(flags) or 'no vector flags listed'}"


def _backend_started() -> bool:
    """Whether a JAX backend exists already (then XLA read its flags before kvjax set
    them), read without importing JAX."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


# XLA reads its flags once, when JAX's backend starts: if that was before kvjax's import,
# the flags in force are not XLA_FLAGS' (kvjax.decode.programs then keeps nothing)
STARTED_BEFORE_FLAGS = _backend_started()
set_xla_flags()
