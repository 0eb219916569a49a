"""The attention-kernel switch: one decode step (T == 1) over the paged cache by a Pallas kernel.

Legend: B batch, N query heads, K kv heads, G = N // K query heads per kv head, H head dim,
P pages per sequence (page-table width).

JAX ships two paged-attention kernels that read kvjax's cache layout as it is
(`cache.k[layer]`: [K, num_pages, page_size, H]). `resolve_backend` picks one (or the
reference) for a model; `paged_decode_attention` runs it with the semantics of
`paged_attention_reference` for one new token per row: the query scale (1/sqrt(H), or the
model's `query_scale`; neither kernel scales), grouped heads (head n reads kv head n // G in
both), keys at positions < lengths + num_new (an inactive row, num_new == 0, attends to its
cached keys; a row with no keys returns 0). Prefill (T > 1) stays with the reference.

What the kernels lack, and what `resolve_backend` does about it (falls back to "reference",
with one warning per reason):
  both        no sliding window (they mask only positions >= length; a model with any
              sliding layer falls back whole), no score soft-capping (Gemma 2). Masked
              slots are
              still multiplied in (weight 0 times V; the TPU kernel also adds the mask to
              q.K), so a NaN-poisoned page (`poison_freed`) in the unwritten tail of a
              sequence's last page turns the output NaN, where the reference zeroes it.
  pallas_gpu  Triton loads need power-of-two sizes (head_dim 24 does not lower) and its dots
              need dims >= 16: head_dim a power of two >= 16, page_size a power of two. Any
              G works: the kernel pads each group to 16 query rows, so MHA computes 16 rows
              for each one it uses.
  pallas_tpu  rounds K and V to bfloat16 inside the kernel, so a float32 cache falls back;
              head_dim a multiple of 128 (64 does not lower); page_size a multiple of 16 (the
              bfloat16 sublane tile; lowering does not check it and no TPU was tried here).
              Upstream's own test of this kernel is skipped for data races; interpret mode's
              race detector finds none in the shapes tested here.

Tolerance (tests/test_kernels.py, interpret mode on CPU): both kernels match the reference
within `tol(float32)` = 1e-5 abs and rel on float32 queries (the TPU kernel on a bfloat16
cache; measured <= 1e-6), and within `tol(bfloat16)` = 2e-2 with bfloat16 queries and cache,
where the reference itself accumulates in bfloat16 (measured 1.6e-2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu import paged_attention as gpu_kernel
from jax.experimental.pallas.ops.tpu import paged_attention as tpu_kernel
from jax.sharding import Mesh, PartitionSpec

from kvjax.cache.paged import DTYPES, QUANTIZED, BatchInfo, PagedKVCache
from kvjax.config import CacheConfig, ModelConfig
from kvjax.model.attention import paged_attention_reference

BACKENDS = ("reference", "pallas_gpu", "pallas_tpu")
_AUTO = {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}
_GPU_BLOCK_H = 16  # query rows per kernel instance; the kernel requires a multiple of 16
_GPU_MIN_BLOCK = 16  # tokens per compute block: the least dimension of a Triton dot
_GPU_MAX_SPLITS = 16  # sequence partitions reduced in parallel (the kernel's default)

# The documented tolerance of a kernel against the reference, abs and rel, by query dtype.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}

_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """The decode-attention kernel a step runs (a static argument: hashable)."""

    backend: str = "reference"  # one of BACKENDS
    interpret: bool = False  # Pallas interpret mode (runs a GPU/TPU kernel on CPU: tests)


def kernel_limits(backend: str, *, head_dim: int, page_size: int | None = None,
                  cache_dtype=None, window: int | None = None,
                  poison_freed: bool = False, softcap: float | None = None) -> list[str]:
    """Why `backend` cannot compute this attention exactly; empty when it can.

    `page_size` and `cache_dtype` are checked only when given.
    """
    reasons = []
    if backend == "reference":
        return reasons
    if window is not None:
        reasons.append(f"{backend} has no sliding window (sliding_window={window})")
    if softcap is not None:
        reasons.append(f"{backend} has no score soft-capping (attn_softcap={softcap})")
    if poison_freed:
        reasons.append(f"{backend} multiplies masked slots in, so NaN-poisoned freed pages "
                       "would leak into outputs (poison_freed=True)")
    if cache_dtype is not None and jnp.dtype(cache_dtype).name in QUANTIZED:
        reasons.append(f"{backend} reads float pages; {jnp.dtype(cache_dtype).name} pages (a "
                       f"scale per token and KV head) are dequantized by the reference")
    if cache_dtype is not None and jnp.dtype(cache_dtype) == jnp.uint8:  # int4_kivi's
        reasons.append(f"{backend} reads float pages; int4_kivi pages (and each row's float "
                       f"open page) are read by the reference")
    if backend == "pallas_gpu":
        if head_dim < 16 or head_dim & (head_dim - 1):
            reasons.append(f"pallas_gpu needs head_dim a power of two >= 16, got {head_dim}")
        if page_size is not None and page_size & (page_size - 1):
            reasons.append(f"pallas_gpu needs page_size a power of two, got {page_size}")
    elif backend == "pallas_tpu":
        if cache_dtype is not None and jnp.dtype(cache_dtype) == jnp.dtype(jnp.float32):
            reasons.append(f"pallas_tpu rounds K/V to bfloat16; the cache is "
                           f"{jnp.dtype(cache_dtype).name}")
        if head_dim % 128:
            reasons.append(f"pallas_tpu needs head_dim a multiple of 128, got {head_dim}")
        if page_size is not None and page_size % 16:
            reasons.append(f"pallas_tpu needs page_size a multiple of 16, got {page_size}")
    return reasons


def resolve_backend(name: str, config: ModelConfig, platform: str | None = None, *,
                    cache: CacheConfig | None = None, poison_freed: bool = False) -> str:
    """The backend to run: `name` ("auto" or one of BACKENDS) or "reference" where the kernel
    cannot run `config` exactly, which `warnings.warn` says once per reason per process.

    "auto" picks the kernel of `platform` (default: `jax.default_backend()`). An explicit
    kernel is kept on any platform; off its hardware it runs only with `interpret=True`.
    Page-size and cache-dtype limits are checked only when `cache` is given.
    """
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown attention backend {name!r}; choose one of "
                         f"{', '.join(map(repr, ('auto', *BACKENDS)))}")
    if name == "auto":
        name = _AUTO.get(platform or jax.default_backend(), "reference")
    reasons = kernel_limits(
        name, head_dim=config.head_dim, poison_freed=poison_freed,
        window=next((w for w in config.windows if w is not None), None),
        softcap=config.attn_softcap,
        page_size=None if cache is None else cache.page_size,
        cache_dtype=None if cache is None else DTYPES[cache.dtype])
    for reason in reasons:
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"attention backend falls back to 'reference': {reason}",
                          stacklevel=2)
    return "reference" if reasons else name


def gpu_tiling(page_size: int, block_pages: int, pages_per_seq: int) -> tuple[int, int, int]:
    """(pages per compute block, k_splits, padded page-table width) for the GPU kernel.

    A compute block is the largest power of two of pages <= the reference's attention block,
    widened to at least 16 tokens; the table is padded to whole blocks and split into at most
    16 equal partitions.
    """
    pages = 1 << (block_pages.bit_length() - 1)
    while pages * page_size < _GPU_MIN_BLOCK:
        pages *= 2
    blocks = -(-pages_per_seq // pages)
    splits = max(d for d in range(1, _GPU_MAX_SPLITS + 1) if blocks % d == 0)
    return pages, splits, blocks * pages


def paged_decode_attention(q: jax.Array, cache: PagedKVCache, layer: int, batch: BatchInfo,
                           backend: str, interpret: bool = False, *,
                           window: int | None = None, scale: float | None = None,
                           softcap: float | None = None) -> jax.Array:
    """Decode attention of one new token per row over the paged cache (which holds it).

    Same result as `paged_attention_reference(q, cache, layer, batch, window, scale=scale,
    softcap=softcap)`; "reference" runs exactly that. A kernel backend copies this layer of
    the pool (`cache.k[layer]`) for the kernel and refuses, at trace time, a window, a
    soft-cap or a shape `kernel_limits` rules out.
    `interpret=True` runs a kernel in Pallas interpret mode (on CPU: tests).

    Args:
      q: [B, 1, N, H], queries at positions `batch.lengths`.
    Returns: [B, 1, N, H]
    """
    if backend == "reference":
        return paged_attention_reference(q, cache, layer, batch, window, scale=scale,
                                         softcap=softcap)
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    t, h = q.shape[1], q.shape[3]
    if t != 1:
        raise ValueError(f"{backend} decodes one token per row; got {t} (prefill: reference)")
    reasons = kernel_limits(backend, head_dim=h, page_size=cache.page_size,
                            cache_dtype=cache.dtype, window=window, softcap=softcap)
    if reasons:
        raise ValueError("; ".join(reasons))
    with jax.named_scope(f"attention_{backend}"):
        factor = h**-0.5 if scale is None else scale  # as the reference scales
        qs = q[:, 0] * jnp.asarray(factor, q.dtype)  # [B, N, H]
        end = batch.lengths + batch.num_new  # [B] keys at or past `end` are unwritten
        # Kernels read pages by raw id; clamp as the reference's gather does.
        table = jnp.clip(batch.page_table, 0, cache.num_pages - 1)  # [B, P]
        if backend == "pallas_gpu":
            pages, splits, width = gpu_tiling(cache.page_size, cache.block_pages,
                                              table.shape[1])
            table = jnp.pad(table, ((0, 0), (0, width - table.shape[1])))
            out = gpu_kernel.paged_attention(
                qs, cache.read(cache.k[layer]).astype(q.dtype),
                cache.read(cache.v[layer]).astype(q.dtype), table, end,
                block_h=_GPU_BLOCK_H, pages_per_compute_block=pages, k_splits=splits,
                interpret=interpret)
        else:
            pages = math.gcd(cache.block_pages, table.shape[1])
            mode = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
            with mode:
                out = tpu_kernel.paged_attention(qs, cache.read(cache.k[layer]),
                                                 cache.read(cache.v[layer]), end, table,
                                                 pages_per_compute_block=pages)
    return out[:, None]


def sharded_paged_decode_attention(q: jax.Array, cache: PagedKVCache, layer: int,
                                   batch: BatchInfo, backend: str, *, mesh: Mesh,
                                   cache_spec: PartitionSpec, batch_axis: str | None = "data",
                                   interpret: bool = False, window: int | None = None,
                                   scale: float | None = None,
                                   softcap: float | None = None) -> jax.Array:
    """`paged_decode_attention` under a device mesh: each device runs the kernel on its shard.

    A Pallas kernel is one opaque call that GSPMD cannot split (it would gather the whole
    cache onto one device), so it runs under `jax.shard_map`: the cache is split as
    `cache_spec` says ([layers, kv_heads, pages, page_slots, head_dim]; only kv_heads may be
    split: page ids are global and `layer` indexes the whole layer axis), the query heads on
    the same mesh axis as the KV heads (head n's kv head n // G then sits on the same device,
    because both are split into equal contiguous runs), and the batch rows with their
    page-table rows and lengths on `batch_axis` when it divides B. No collective is needed:
    every output element is computed where its query head and kv head live. Where the KV
    heads are replicated (an MQA model on a wide "model" axis) every device computes all
    query heads of its rows.

    Args:
      q: [B, 1, N, H]
    Returns: [B, 1, N, H], split like q.
    """
    spec = tuple(cache_spec) + (None,) * (5 - len(cache_spec))
    if spec[0] is not None or any(axis is not None for axis in spec[2:]):
        raise ValueError(f"only the kv_heads axis of the cache may be split, got {cache_spec}")
    heads = spec[1]
    rows = None
    if batch_axis in mesh.shape and q.shape[0] % mesh.shape[batch_axis] == 0:
        rows = batch_axis
    q_spec = PartitionSpec(rows, None, heads, None)
    batch_spec = BatchInfo(page_table=PartitionSpec(rows, None), lengths=PartitionSpec(rows),
                           num_new=PartitionSpec(rows), position_offset=None)
    local_batch = BatchInfo(page_table=batch.page_table, lengths=batch.lengths,
                            num_new=batch.num_new)

    def local(q, cache, batch):
        return paged_decode_attention(q, cache, layer, batch, backend, interpret, window=window,
                                      scale=scale, softcap=softcap)

    cache_specs = PagedKVCache(k=PartitionSpec(*spec), v=PartitionSpec(*spec),
                               block_pages=cache.block_pages, numbers=cache.numbers)
    # check_vma=False: the kernels' output shapes carry no varying-axes annotation, which
    # shard_map's check requires of a pallas_call.
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, cache_specs, batch_spec),
                         out_specs=q_spec, check_vma=False)(q, cache, local_batch)
