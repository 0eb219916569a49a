"""The one named decode state: what a decode or speculative call is told about each row.

Every decode driver builds it with `decode_state` (the engine's runner and its speculative
plug-in, `generate()`, the model drafter, the benchmarks) and the device loops take it
(`kvjax.decode.steps.decode_loop`, `kvjax.speculative.loop.spec_loop`); the sampling knobs
come from one builder (`kvjax.decode.sampling.sampling_rows`).

Legend: B rows, P pages per row, K stop ids per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import numpy as np

from kvjax.config import SamplingConfig
from kvjax.decode.sampling import sampling_rows


@flax.struct.dataclass
class DecodeState:
    """Per-row inputs of a decode call; rows with budget 0 do nothing."""

    page_table: jax.Array  # int32[B, P]
    lengths: jax.Array  # int32[B] tokens cached
    last: jax.Array  # int32[B] the newest token, fed first (not cached yet)
    budget: jax.Array  # int32[B] tokens to emit
    keys: jax.Array  # uint32[B, 2] sequence keys (`kvjax.decode.sampling.sequence_keys`)
    temperature: jax.Array  # float32[B] (0: greedy)
    top_k: jax.Array  # int32[B] (0: off)
    top_p: jax.Array  # float32[B] (1: off)
    stop_ids: jax.Array  # int32[B, K] any of a row's ids ends it (-1: none); [B]: K = 1
    position_offset: jax.Array | None = None  # int32[B] model position of cache slot 0
    adapter_ids: jax.Array | None = None  # int32[B] LoRA adapter per row (0: none)
    open_rows: jax.Array | None = None  # int32[B] int4_kivi pages: a row's open page

    @property
    def stops(self) -> jax.Array:
        """`stop_ids` as [B, K] (a [B] array is one id per row, never another row's)."""
        return self.stop_ids if self.stop_ids.ndim == 2 else self.stop_ids[:, None]

    @property
    def knobs(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(temperature, top_k, top_p), the order `sample` and `probabilities` take."""
        return self.temperature, self.top_k, self.top_p


def decode_state(page_table, lengths, last, budget, keys,
                 samplings: Sequence[SamplingConfig | None] = (), stop_ids=None,
                 position_offset=None, adapter_ids=None, open_rows=None) -> DecodeState:
    """A DecodeState from host arrays. `samplings`: one SamplingConfig (or None: greedy) per
    row, rows past its end greedy; `stop_ids`: int32[B] or [B, K] (None: no stop id);
    `open_rows`: int4_kivi pages' open page of each row (`kvjax.cache.kivi`)."""
    rows = len(lengths)
    stops = (np.full((rows, 1), -1, np.int32) if stop_ids is None
             else np.asarray(stop_ids, np.int32).reshape(rows, -1))
    return DecodeState(
        page_table=np.asarray(page_table, np.int32), lengths=np.asarray(lengths, np.int32),
        last=np.asarray(last, np.int32), budget=np.asarray(budget, np.int32),
        keys=np.asarray(keys, np.uint32), **dict(zip(
            ("temperature", "top_k", "top_p"), sampling_rows(samplings, rows), strict=True)),
        stop_ids=stops,
        position_offset=None if position_offset is None else np.asarray(position_offset,
                                                                          np.int32),
        adapter_ids=None if adapter_ids is None else np.asarray(adapter_ids, np.int32),
        open_rows=None if open_rows is None else np.asarray(open_rows, np.int32))
