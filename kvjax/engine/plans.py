"""The engine's numerics plans: how the target's and the draft's steps run their products,
chosen once at start-up from the engine's settings and probes of the running backend
(`kvjax.model.tiled.choose_blocks`), and whether kvjax's CPU kernel runs them."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

from kvjax.config import EngineConfig, ModelConfig
from kvjax.decode.batching import bucket
from kvjax.model.lora import choose_block
from kvjax.model.plan import NumericsPlan, layers_alike
from kvjax.model.tiled import PROBED, Calls, check_backend, choose_blocks


def numerics_plans(configs: list[ModelConfig], ec: EngineConfig, gamma: int,
                   lora_shapes: Sequence[tuple[int, int, int, int]] = (),
                   extra: Sequence[dict] = ()) -> list:
    """The numerics plan (`kvjax.model.plan.NumericsPlan`) of each of `configs` (the
    target's, the draft's) under the engine's settings, then what still fails: the mode is
    `ec.numerics`, and under invariant numerics each product's row block
    (`kvjax.model.tiled.choose_blocks`, probed per shape on the running backend and cached)
    for the engine's largest calls: `bucket(max_slots)` sequences of up to
    max(prefill_chunk, gamma + 1) tokens each (logits for gamma + 1 of them: prefill keeps
    the last token's), or one prompt with all of a call's tokens (a widened prefill call),
    attention over blocks of `attn_block` keys, and never less than
    `kvjax.model.tiled.PROBED`, so that the choice (and so a request's bits) does not change
    with max_slots, the chunk or gamma inside those bounds (`gamma`: the slots a verify
    writes past the history, `kvjax.speculative.plugin.write_ahead`); with `lora_shapes` (the
    target's stacked adapters, `kvjax.model.lora.stacked_shapes`) the LoRA deltas' block
    too (`kvjax.model.lora.choose_block`); `extra[i]`: products `configs[i]`'s steps run
    beyond its layers' and head's, probed with them (an EAGLE head's fusion and draft logits,
    `kvjax.speculative.eagle.head_products`). Problems come with the backend check (a
    warning names the products). A plan is part of the cache identity."""
    base = NumericsPlan(ec.numerics, ec.row_block,
                        fused=ec.fused_projections and ec.mesh is None,
                        cpu_kernel=cpu_kernel_choice(ec)[0])
    bases = [dataclasses.replace(base, cpu_attention=attention, layer_loop=ec.layer_loop
                                 and layer_loop_choice(c, base.cpu_kernel and attention,
                                                       lora=i == 0 and bool(lora_shapes)))
        for i, c in enumerate(configs) for attention in (cpu_attention_choice(ec, c)[0],)]
    if not base.invariant:
        return [*bases, []]
    width, seqs = max(ec.cache.prefill_chunk, gamma + 1), bucket(ec.max_slots)
    # a packed decode step (`EngineConfig.packed_prefill`) holds a decode token per slot
    # beside up to `bucket(max_slots)` prompts' slices, and a head row for each
    calls = Calls(rows=max(seqs * (width + 1), PROBED.rows),
                  head_rows=max(seqs * max(gamma + 1, 2), PROBED.head_rows),
                  # a widened prefill call (`StepRunner.call_width`) gives one prompt all of
                  # a call's tokens
                  queries=max(seqs * ec.cache.prefill_chunk, gamma + 1, PROBED.queries),
                  keys=ec.cache.block_pages * ec.cache.page_size)
    plans, problems = [], []
    extra = list(extra) + [{}] * (len(configs) - len(extra))
    for i, (c, base, more) in enumerate(zip(configs, bases, extra, strict=True)):
        blocks, transposed, failed = choose_blocks(
            c, base, calls, transpose=ec.transposed_kernels and ec.mesh is None, extra=more)
        if i == 0 and lora_shapes:  # the target's adapters (the draft runs without)
            block = choose_block(lora_shapes, calls.rows, base.row_block)
            blocks += (("lora", base.row_block if block is None else block),)
            failed += [] if block is not None else ["lora"]
        plans.append(dataclasses.replace(base, row_blocks=blocks, transposed=transposed))
        problems += [p for p in failed if p not in problems]
    problems += check_backend()
    if problems:
        warnings.warn(f"kvjax numerics='invariant' does not hold on this backend for: "
                      f"{'; '.join(problems)}. A request's bits may change with its batch.",
                      RuntimeWarning, stacklevel=3)
    return [*plans, problems]


def cpu_kernel_choice(ec: EngineConfig) -> tuple[bool, str]:
    """(whether the engine's products run on kvjax's CPU kernel, which products run and
    why, in words: `Engine.products`), from `EngineConfig.cpu_kernel` ("products" and
    "auto" use it where it runs)."""
    if ec.cpu_kernel == "off":
        return False, "XLA's products (cpu_kernel='off')"
    if ec.mesh is not None:
        return False, "XLA's products (the CPU kernel is not used on a mesh)"
    from kvjax.cpu.product import kernel

    return kernel().available, kernel().describe()


def layer_loop_choice(config: ModelConfig, cpu_kernels: bool, lora: bool) -> bool:
    """Whether `config`'s steps run its layers as one loop (`NumericsPlan.layer_loop`: one
    block's program for every layer, the same bits): where both CPU kernels run (they read
    a layer's kernels and pages in place), the model has several layers alike (one window
    and RoPE) and no LoRA adapters are served."""
    return cpu_kernels and not lora and config.num_layers > 1 and layers_alike(config)


def cpu_attention_choice(ec: EngineConfig, config: ModelConfig) -> tuple[bool, str]:
    """(whether `config`'s paged attention runs on kvjax's CPU kernel, and in words), from
    `EngineConfig.cpu_kernel`: "auto" where the kernel runs the products and reads the
    engine's pages (`kvjax.cpu.attention.unsupported`)."""
    if ec.cpu_kernel != "auto":
        return False, f"XLA's attention (cpu_kernel={ec.cpu_kernel!r})"
    if not cpu_kernel_choice(ec)[0]:
        return False, "XLA's attention (no CPU kernel)"
    from kvjax.cpu.attention import unsupported

    why = unsupported(ec.cache.dtype, config.attn_softcap)
    if why:
        return False, f"XLA's attention (the CPU kernel does not read {why})"
    return True, "attention by kvjax's CPU kernel"


def numerics_blocks(configs: list[ModelConfig], ec: EngineConfig, gamma: int,
                    lora_shapes: Sequence[tuple[int, int, int, int]] = ()) -> list:
    """Deprecated: `numerics_plans` (the plans are no longer part of the model configs)."""
    warnings.warn("kvjax.engine.engine.numerics_blocks is now numerics_plans, which returns "
                  "the NumericsPlan of each config (kvjax.model.plan)", DeprecationWarning,
                  stacklevel=2)
    return numerics_plans(configs, ec, gamma, lora_shapes)
