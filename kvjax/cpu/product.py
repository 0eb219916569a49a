"""The row-count-invariant product on XLA CPU (kvjax/cpu/product.cc) called from JAX.

`kernel()` builds or loads the library once per process (`kvjax.cpu.build`) and registers
it with XLA as the FFI target "kvjax_product"; it says whether the kernel is in use and,
where not, why (no compiler, a failed build, a backend other than CPU, or
`KVJAX_CPU_KERNEL=0`): then the pure-JAX products run. `pack` lays a kernel [I, O] out in
the panels the library streams, once at load; `product` is x [..., I] times it.

A row's bits from `product` depend on that row's values alone: the same for 1 row or 512,
whatever rows sit beside it (each output one fused-multiply-add chain over the inputs in
index order). They are not XLA's bits: the kernel in use is part of the numerics plan.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os

import jax
import jax.numpy as jnp

PANEL = 64  # outputs per packed panel (product.cc's PANEL)
TARGET = "kvjax_product"


@dataclasses.dataclass(frozen=True)
class Kernel:
    available: bool
    reason: str  # how it was loaded, or why it is not in use
    isa: str = ""  # the vector instructions it was built for: avx512, avx2 or scalar

    def describe(self) -> str:
        if self.available:
            return f"kvjax CPU product kernel ({self.isa}; {self.reason})"
        return f"pure-JAX products (kvjax CPU kernel not in use: {self.reason})"


_KERNEL: Kernel | None = None


def _load() -> Kernel:
    from kvjax.cpu.build import build

    if os.environ.get("KVJAX_CPU_KERNEL", "1") == "0":
        return Kernel(False, "KVJAX_CPU_KERNEL=0")
    if jax.default_backend() != "cpu":
        return Kernel(False, f"the backend is {jax.default_backend()}, not cpu")
    import jaxlib

    made = build(jax.ffi.include_dir(), jaxlib.__version__)
    if made.path is None:
        return Kernel(False, made.reason)
    try:
        lib = ctypes.cdll.LoadLibrary(str(made.path))
    except OSError as e:
        return Kernel(False, f"{made.path} did not load: {e}")
    lib.kvjax_product_isa.restype = ctypes.c_char_p
    lib.kvjax_product_panel.restype = ctypes.c_int64
    if lib.kvjax_product_panel() != PANEL:
        return Kernel(False, f"{made.path} packs {lib.kvjax_product_panel()} outputs a panel")
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.KvjaxProduct), platform="cpu")
    return Kernel(True, made.reason, lib.kvjax_product_isa().decode())


def kernel() -> Kernel:
    """The kernel of this process, built or loaded on the first call (module docstring)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _load()
    return _KERNEL


def pack(w: jax.Array) -> jax.Array:
    """kernel [I, O] -> float32[ceil(O / PANEL), I, PANEL]: panel p holds outputs
    p * PANEL .. p * PANEL + PANEL - 1, zero past O."""
    i, o = w.shape
    count = -(-o // PANEL)
    w = jnp.pad(jnp.asarray(w, jnp.float32), ((0, 0), (0, count * PANEL - o)))
    return w.reshape(i, count, PANEL).transpose(1, 0, 2)


def product(x: jax.Array, packed: jax.Array, out_features: int) -> jax.Array:
    """x [..., I] times the packed kernel (`pack`) -> float32 [..., out_features], each
    row's bits its own (module docstring). Needs `kernel().available`."""
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows.shape[0], out_features),
                                                      jnp.float32))(rows, packed)
    return y.reshape(*x.shape[:-1], out_features)
