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
"""

from __future__ import annotations

import importlib.metadata
import os

FUSION_FLAG = "--xla_cpu_use_fusion_emitters"
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


def fusion_emitters_off(environ=os.environ) -> bool:
    """Whether XLA_FLAGS turns XLA CPU's fusion emitters off (the last setting wins)."""
    value = None
    for flag in environ.get("XLA_FLAGS", "").split():
        if flag.startswith(FUSION_FLAG + "="):
            value = flag.split("=", 1)[1].lower()
    return value in ("false", "0")


set_xla_flags()
