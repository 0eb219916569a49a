"""The row-count-invariant product on XLA CPU (kvjax/cpu/product.cc) called from JAX.

`kernel()` builds or loads the library once per process (`kvjax.cpu.build`) and registers
its products (plain, transposed, and one layer of a stack) and its paged attention
(`kvjax.cpu.attention`) with XLA as FFI targets;
it says whether the kernel is in use and, where not, why (no compiler, a failed build, a
backend other than CPU, or `KVJAX_CPU_KERNEL=0`): then the pure-JAX products run.
`product` takes a Dense kernel [I, O] packed once at load (`pack`: the same shape, another
order; `kvjax.model.layout.store`) or a tied head's embedding [O, I] as it is.

A row's bits from `product` depend on that row's values alone: the same for 1 row or 512,
whatever rows sit beside it (the order of each output's sum is fixed by I alone:
product.cc). They are not XLA's bits: the kernel in use is part of the numerics plan.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os

import jax
import jax.numpy as jnp

TARGET, TARGET_T = "kvjax_product", "kvjax_product_t"  # w [I, O]; w [O, I]
TARGET_STACKED = "kvjax_product_stacked"  # w [L, I, O] and a layer index
TARGET_ATTENTION = "kvjax_attention"  # kvjax.cpu.attention's (_load registers all three)


@dataclasses.dataclass(frozen=True)
class Kernel:
    available: bool
    reason: str  # how it was loaded, or why it is not in use
    isa: str = ""  # the vector instructions it was built for: avx512, avx2 or scalar
    library: str = ""  # the loaded library's path

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
    for name, fn in ((TARGET, lib.KvjaxProduct), (TARGET_T, lib.KvjaxProductT),
                     (TARGET_STACKED, lib.KvjaxProductStacked),
                     (TARGET_ATTENTION, lib.KvjaxAttention)):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform="cpu")
    return Kernel(True, made.reason, lib.kvjax_product_isa().decode(), str(made.path))


def kernel() -> Kernel:
    """The kernel of this process, built or loaded on the first call (module docstring)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _load()
    return _KERNEL


PANEL = 64  # outputs per packed panel (product.cc)


def pack(w: jax.Array, inputs: int = 1) -> jax.Array:
    """A kernel [in..., out...] (its first `inputs` axes the inputs) in the order
    `product` streams, same shape: over I = prod(in) and O = prod(out), the first
    O - O % 64 outputs in panels of 64 ([O // 64, I, 64]), then the rest as [I, O % 64]."""
    i = math.prod(w.shape[:inputs])
    flat = w.reshape(i, -1)
    full = flat.shape[1] // PANEL * PANEL
    panels = flat[:, :full].reshape(i, -1, PANEL).transpose(1, 0, 2)
    return jnp.concatenate([panels.reshape(-1), flat[:, full:].reshape(-1)]).reshape(w.shape)


def unpack(w: jax.Array, inputs: int = 1) -> jax.Array:
    """`pack` undone."""
    i = math.prod(w.shape[:inputs])
    o = w.size // i
    full = o // PANEL * PANEL
    flat = w.reshape(-1)
    panels = flat[:i * full].reshape(-1, i, PANEL).transpose(1, 0, 2).reshape(i, full)
    rest = flat[i * full:].reshape(i, o - full)
    return jnp.concatenate([panels, rest], axis=1).reshape(w.shape)


def product(x: jax.Array, w: jax.Array, transposed: bool = False,
            layer: jax.Array | int | None = None) -> jax.Array:
    """x [..., I] times w [I, O] packed (`pack`: a Dense kernel), or times w [O, I]
    transposed (a tied head's embedding, as stored) -> float32 [..., O], each row's bits
    its own (module docstring). With `layer` (an int or int32 scalar, traced or not): w is
    a stack [L, I, O] of packed kernels and layer `layer`'s is used, read in place (a loop
    over layers copies no weights). Needs `kernel().available` (a clear error otherwise)."""
    if not kernel().available:
        raise RuntimeError(f"kvjax.cpu.product: {kernel().describe()}")
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    w = jnp.asarray(w, jnp.float32)
    if layer is not None:
        if transposed or w.ndim != 3:
            raise ValueError(f"kvjax.cpu.product: a stacked product takes w [L, I, O], "
                             f"not transposed; got {w.shape}, transposed={transposed}")
        index = jnp.asarray(layer, jnp.int32).reshape(1)
        y = jax.ffi.ffi_call(TARGET_STACKED, jax.ShapeDtypeStruct(
            (rows.shape[0], w.shape[2]), jnp.float32))(rows, w, index)
        return y.reshape(*x.shape[:-1], w.shape[2])
    out = w.shape[0] if transposed else w.shape[1]
    y = jax.ffi.ffi_call(TARGET_T if transposed else TARGET,
                         jax.ShapeDtypeStruct((rows.shape[0], out), jnp.float32))(rows, w)
    return y.reshape(*x.shape[:-1], out)


@dataclasses.dataclass(frozen=True)
class KernelDot:
    """A `lax.dot_general` for Flax's Dense and DenseGeneral (w [in..., out...] packed, its
    leading axes contracted) and for a tied head (w [V, D], its last axis contracted) by
    `product`: the input's trailing axes are contracted, every other input axis is a row
    axis, and no batch axes. Float32 products (other dtypes are cast to it and the result back)."""

    def __call__(self, x: jax.Array, w: jax.Array, dimension_numbers, precision=None,
                 preferred_element_type=None) -> jax.Array:
        (x_contract, w_contract), (x_batch, w_batch) = dimension_numbers
        n = len(x_contract)
        x_contract = tuple(a % x.ndim for a in x_contract)
        w_contract = tuple(a % w.ndim for a in w_contract)
        leading, trailing = tuple(range(n)), tuple(range(w.ndim - n, w.ndim))
        if x_batch or w_batch or x_contract != tuple(range(x.ndim - n, x.ndim)) or \
                w_contract not in (leading, trailing):
            raise ValueError(f"KernelDot: contract the input's trailing axes with the "
                             f"weights' leading or trailing ones, got {dimension_numbers}")
        transposed = w_contract != leading
        inputs = math.prod(x.shape[x.ndim - n:])
        outs = w.shape[:w.ndim - n] if transposed else w.shape[n:]
        w2 = w.reshape(-1, inputs) if transposed else w.reshape(inputs, -1)
        y = product(x.reshape(-1, inputs), w2, transposed)
        dtype = preferred_element_type or jnp.result_type(x, w)
        return y.reshape(*x.shape[:x.ndim - n], *outs).astype(dtype)
