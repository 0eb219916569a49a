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

A fused plan (`NumericsPlan.fused`) also takes q, k and v as one kernel ("qkv", [D, N + 2K,
H]) and a gated MLP's gate and up as one ("gate_up", [D, 2F]): `store` concatenates them
once, the model splits the products' outputs, and `canonical` gives back the separate
kernels users hold.

Legend: D model width, N heads, K kv heads, H head dim, F feed-forward width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cpu.product import pack, unpack

SCOPE = "stored_kernels"

# product -> (module path inside a layer or at the top, inputs axes contracted at the front)
KERNELS = {"q": ((("attn", "q"),), 1), "k/v": ((("attn", "k"), ("attn", "v")), 1),
           "qkv": ((("attn", "qkv"),), 1), "o": ((("attn", "o"),), 2),
           "mlp up": ((("mlp", "gate"), ("mlp", "up"), ("mlp", "gate_up")), 1),
           "mlp down": ((("mlp", "down"),), 1), "head": ((("lm_head",),), 1),
           "eagle fc": ((("fc",),), 1)}  # an EAGLE head's fusion: packed for the CPU kernel
# fused kernel -> (module holding it, the kernels it concatenates, the kernels' first output
# axis: q/k/v are [D, heads, H], gate/up [D, F]; a bias's is 0)
FUSED = {"qkv": ("attn", ("q", "k", "v"), 1), "gate_up": ("mlp", ("gate", "up"), -1)}


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Stored:
    """Parameters whose `products`' kernels are stored transposed (a pytree: jit takes it)."""

    tree: Any
    products: tuple[str, ...]
    fused: bool = False  # q/k/v and gate/up concatenated (`NumericsPlan.fused`)
    packed: bool = False  # every kernel packed for the CPU kernel (`NumericsPlan.cpu_kernel`)
    stacked: bool = False  # the layers' parameters stacked (`NumericsPlan.layer_loop`)

    def tree_flatten(self):
        return (self.tree,), (self.products, self.fused, self.packed, self.stacked)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)


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


def _each_fused(params: dict, fn) -> dict:
    """params with fn(module dict, fused name, separate names, output axis) applied, on
    copies, to every layer's module of each `FUSED` kernel."""
    out = dict(params)
    for key, layer in params.items():
        if key.startswith("layer_"):
            layer = {part: dict(mods) for part, mods in layer.items()}
            for name, (part, names, axis) in FUSED.items():
                fn(layer[part], name, names, axis)
            out[key] = layer
    return out


def fuse(params: dict) -> dict:
    """Each layer's q/k/v kernels (and biases) concatenated into "qkv", a gated MLP's gate and
    up into "gate_up" (output axes: [D, N, H] + [D, K, H] x 2 -> [D, N + 2K, H])."""

    def join(module, name, names, axis):
        if all(n in module for n in names):  # an ungated MLP has no gate
            parts = [module.pop(n) for n in names]
            module[name] = {leaf: jnp.concatenate([p[leaf] for p in parts],
                                                  axis=axis if leaf == "kernel" else 0)
                            for leaf in parts[0]}

    return _each_fused(params, join)


def unfuse(params: dict, config) -> dict:
    """`fuse` undone: the separate kernels of `config`'s q, k, v, gate and up."""
    widths = {"qkv": (config.num_heads, config.num_kv_heads, config.num_kv_heads),
              "gate_up": (config.d_ff, config.d_ff)}

    def split(module, name, names, axis):
        if name in module:
            fused, cuts = module.pop(name), np.cumsum(widths[name])[:-1]
            pieces = {leaf: jnp.split(a, cuts, axis=axis if leaf == "kernel" else 0)
                      for leaf, a in fused.items()}
            for i, n in enumerate(names):
                module[n] = {leaf: pieces[leaf][i] for leaf in fused}

    return _each_fused(params, split)


def stack_layers(params: dict) -> dict:
    """Every `layer_{i}` subtree stacked into one, "layers", its leaves [L, ...] (the layer
    loop's parameters: `kvjax.model.transformer.Transformer.layer_loop`)."""
    names = sorted((k for k in params if k.startswith("layer_")), key=lambda k: int(k[6:]))
    out = {k: v for k, v in params.items() if not k.startswith("layer_")}
    out["layers"] = jax.tree.map(lambda *leaves: jnp.stack(leaves),
                                 *(params[k] for k in names))
    return out


def unstack_layers(params: dict) -> dict:
    """`stack_layers` undone."""
    out = {k: v for k, v in params.items() if k != "layers"}
    count = jax.tree.leaves(params["layers"])[0].shape[0]
    for i in range(count):
        out[f"layer_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"])
    return out


def store(params: dict, plan) -> dict | Stored:
    """The parameters as the steps of a `NumericsPlan` take them: its `transposed` products'
    kernels stored transposed, for a fused plan q/k/v and gate/up concatenated, for the CPU
    kernel every kernel packed (`kvjax.cpu.product.pack`: a tied head's embedding, which
    the input lookup reads too, stays), for the layer loop the layers stacked
    (`stack_layers`); the plain tree when there is none of these."""
    products, fused, packed = tuple(plan.transposed), plan.fused, plan.cpu_kernel
    stacked = plan.layer_loop
    if not products and not fused and not packed:
        return params
    tree = fuse(params) if fused else params
    if packed:
        tree = _map_kernels(tree, tuple(KERNELS), pack)
    tree = _map_kernels(tree, products, to_stored)
    return Stored(stack_layers(tree) if stacked else tree, products, fused, packed, stacked)


def unstored(params: dict | Stored, plan) -> dict:
    """The tree the model takes under `plan`, inside a jitted step, of parameters that must
    be stored as `plan` says (transposed views; fused kernels stay fused); a clear error
    when they were not stored so (their rows would silently lose invariance)."""
    products, fused, packed = tuple(plan.transposed), plan.fused, plan.cpu_kernel
    want = (products, fused, packed, plan.layer_loop)
    held = ((params.products, params.fused, params.packed, params.stacked)
            if isinstance(params, Stored) else ((), False, False, False))
    if held != want:
        def says(how, joint=""):
            return "".join(f" {joint}{word}" for word, on in
                           zip(("fused", "packed", "stacked"), how[1:], strict=True) if on)

        raise ValueError(f"the numerics plan stores {list(products)} transposed"
                         f"{says(want, 'and ')} but the parameters hold {list(held[0])}"
                         f"{says(held)}: "
                         f"pass kvjax.model.layout.store(params, plan)")
    if not products and not fused and not packed:
        return params
    with jax.named_scope(SCOPE):  # names what is left of the views in compiled HLO
        return _map_kernels(params.tree, products, from_stored)


def canonical(params: dict | Stored, config) -> dict:
    """The tree users hold (separate kernels in Flax's layout) of parameters stored for a
    plan's steps (`store`; `config`, the ModelConfig, gives the fused kernels' widths);
    plain parameters as they are."""
    if not isinstance(params, Stored):
        return params
    tree = unstack_layers(params.tree) if params.stacked else params.tree
    tree = _map_kernels(tree, params.products, from_stored)
    if params.packed:
        tree = _map_kernels(tree, tuple(KERNELS), unpack)
    return unfuse(tree, config) if params.fused else tree
