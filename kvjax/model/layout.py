"""Product kernels stored transposed, [outputs..., inputs...], for invariant numerics.

XLA CPU's dot kernel (YNNPACK under jaxlib 0.10) gives a row of `x @ w` the same bits at
every row count M >= 2 when `w` is stored [f, d] (the product contracts w's last axis, as
the tied head does with the embedding [V, D]); with `w` stored [d, f], as Flax keeps a
Dense kernel, most shapes' rows fall into the classes {2..32} and {33+} (measured on every
product shape of the bench model and SmolLM2-135M up to 2,048 rows). So the engine stores
such kernels transposed once, at load (`store`), and the steps hand the model the
canonical view (`unstored`, a `jnp.moveaxis` inside the jitted step), which XLA folds into
the product: the dot reads the stored array, no copy is made, and one product of any row
count replaces the loop of 32-row blocks (`kvjax.model.tiled.choose_blocks` probes which
products gain). The parameter tree keeps its names and Flax sees its usual shapes.

Legend: D model width, N heads, H head dim, F feed-forward width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

SCOPE = "stored_kernels"

# product -> (module path inside a layer or at the top, inputs axes contracted at the front)
KERNELS = {"q": ((("attn", "q"),), 1), "k/v": ((("attn", "k"), ("attn", "v")), 1),
           "o": ((("attn", "o"),), 2), "mlp up": ((("mlp", "gate"), ("mlp", "up")), 1),
           "mlp down": ((("mlp", "down"),), 1), "head": ((("lm_head",),), 1)}


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Stored:
    """Parameters whose `products`' kernels are stored transposed (a pytree: jit takes it)."""

    tree: Any
    products: tuple[str, ...]

    def tree_flatten(self):
        return (self.tree,), self.products

    @classmethod
    def tree_unflatten(cls, products, children):
        return cls(children[0], products)


def to_stored(kernel: jax.Array, inputs: int) -> jax.Array:
    """[inputs..., outputs...] -> [outputs..., inputs...]"""
    n = kernel.ndim
    return jnp.moveaxis(kernel, tuple(range(inputs)), tuple(range(n - inputs, n)))


def from_stored(kernel: jax.Array, inputs: int) -> jax.Array:
    """[outputs..., inputs...] -> [inputs..., outputs...], as a 2-D transpose between two
    reshapes: XLA folds it into the product that contracts the inputs (a transpose of the
    3-D array would be copied before the product flattens it)."""
    outs, ins = kernel.shape[:kernel.ndim - inputs], kernel.shape[kernel.ndim - inputs:]
    flat = kernel.reshape(math.prod(outs), math.prod(ins)).T  # [in, out]
    return flat.reshape(*ins, *outs)


def _map_kernels(params: dict, products: tuple[str, ...], fn) -> dict:
    """params with fn(kernel, inputs) applied to every kernel of `products`."""
    wanted = {path: inputs for p in products for path in KERNELS[p][0]
              for inputs in (KERNELS[p][1],)}

    def visit(path, leaf):
        keys = tuple(getattr(k, "key", k) for k in path)
        body = keys[1:-1] if str(keys[0]).startswith("layer_") else keys[:-1]
        inputs = wanted.get(body) if keys[-1] == "kernel" else None
        return leaf if inputs is None else fn(leaf, inputs)

    return jax.tree_util.tree_map_with_path(visit, params)


def store(params: dict, products: tuple[str, ...]) -> dict | Stored:
    """The parameters as the steps take them when `products` are stored transposed
    (`ModelConfig.transposed`); the plain tree when there are none."""
    if not products:
        return params
    return Stored(_map_kernels(params, products, to_stored), tuple(products))


def unstored(params: dict | Stored, products: tuple[str, ...]) -> dict:
    """The canonical parameter tree, inside a jitted step, of parameters that must hold
    `products` stored transposed; a clear error when they were not stored so (their rows
    would silently lose invariance)."""
    held = params.products if isinstance(params, Stored) else ()
    if tuple(held) != tuple(products):
        raise ValueError(f"the model config stores {list(products)} transposed but the "
                         f"parameters hold {list(held)}: pass "
                         f"kvjax.model.layout.store(params, config.transposed)")
    if not products:
        return params
    with jax.named_scope(SCOPE):  # names what is left of the views in compiled HLO
        return _map_kernels(params.tree, products, from_stored)
