"""Int4 pages grouped by the page (`CacheConfig(dtype="int4_kivi")`, `kvjax.cache.kivi`):
keys per channel over a full page, values per token, the page being filled float32 until
full. What a query sees is exactly its own page in float and earlier pages dequantized;
a token's bits do not depend on how its sequence was cut into calls or on the other rows
of its batch; the stored pages are the quantized float pages; the engine keeps its exact
promises under the format (tier round trips: tests/test_tiers.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, assert_same, engine, params, with_cache
from helpers import attention_reference
from test_quantized_pages import _requests

from kvjax import Engine, EngineConfig, InvalidRequestError, Request
from kvjax.cache import kivi
from kvjax.cache.paged import DTYPES, BatchInfo, cache_bytes, init_cache
from kvjax.decode import steps
from kvjax.decode.generate import generate
from kvjax.decode.prefill import PrefillRow, prefill_rows
from kvjax.memory.calculator import kv_bytes, kv_bytes_per_scalar
from kvjax.model.kernels import kernel_limits
from kvjax.model.plan import INVARIANT

KIVI = with_cache(dtype="int4_kivi")
PS = CACHE.page_size
TABLE = np.arange(3, 3 + 64, dtype=np.int32)  # a row's pages: 3, 4, ... (64 of them)


def test_int4_numbers_pack_two_a_byte_and_come_back():
    q = jnp.asarray(np.arange(16, dtype=np.uint8).repeat(2).reshape(4, 8))
    packed = kivi.pack(q)
    assert packed.dtype == jnp.uint8 and packed.shape == (4, 4)
    np.testing.assert_array_equal(np.asarray(kivi.unpack(packed)), np.asarray(q))
    assert int(kivi.pack(jnp.asarray([[15, 7]], jnp.uint8))[0, 0]) == 0x7F  # low nibble first


def test_keys_grouped_per_channel_over_the_page_values_per_token():
    """Each key channel's minimum over the page becomes 0 and its maximum 15, each value
    vector's over its channels; every number is within half a (float16) step of its value,
    also for a channel far from 0 that a symmetric grid would spread over 15 coarse steps."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, PS, 8)).astype(np.float32) * np.float32([1e-3, 1, 10, 1e3,
                                                                         1, 1, 1, 1])
    k[..., 4] += 40.0  # a channel to one side of 0: its step is its spread / 15, not 40 / 7
    k[..., 5] += 3000.0  # float16 numbers 2 apart there: the grid still covers the channel
    v = rng.standard_normal((3, PS, 8)).astype(np.float32)
    k[0, :, 1] = 0.0  # an all-zero channel: step 0, zeros back
    kq, ks, vq, vs = kivi.quantize_page(jnp.asarray(k), jnp.asarray(v))
    assert ks.shape == (3, 8, 2) and vs.shape == (3, PS, 2) and ks.dtype == jnp.float16
    assert float(ks[0, 1, 0]) == 0 and float(ks[0, 1, 1]) == 0
    ki, vi = np.asarray(kivi.unpack(kq)), np.asarray(kivi.unpack(vq))
    moving = np.asarray(ks[..., 0]) > 0
    moving[:, 5] = False  # its minimum rounded down a float16 step: its lowest number is not 0
    np.testing.assert_array_equal(ki.min(-2)[moving], 0)
    assert (ki.max(-2)[moving] >= 14).all()  # 15, or 14 where float16 rounding widened the grid
    np.testing.assert_array_equal(vi.min(-1), 0)
    back_k = np.asarray(kivi.dequantize_keys(kq, ks, jnp.float32))
    back_v = np.asarray(kivi.dequantize_values(vq, vs, jnp.float32))
    k_step, v_step = np.asarray(ks[..., 0], np.float32), np.asarray(vs[..., 0], np.float32)
    assert (np.abs(back_k - k) <= k_step[:, None, :] * (0.5 + 1e-3)).all()
    assert (np.abs(back_v - v) <= v_step[..., None] * (0.5 + 1e-3)).all()
    spread = k[..., 4].max(-1) - k[..., 4].min(-1)  # [3]
    np.testing.assert_allclose(k_step[:, 4], spread / 15, rtol=0.02)  # measured 0.0055
    wide = np.zeros((1, PS, 8), np.float32)
    wide[0, :2, 0] = [-1e6, 1e6]  # past float16: the step saturates instead of reading NaN
    kq, ks, vq, vs = kivi.quantize_page(jnp.asarray(wide), jnp.asarray(wide))
    assert np.isfinite(np.asarray(kivi.dequantize_keys(kq, ks, jnp.float32))).all()
    assert np.isfinite(np.asarray(kivi.dequantize_values(vq, vs, jnp.float32))).all()


@jax.jit
def _round_trip(pk, pv):
    """Pages [P, K, page, H] quantized and dequantized: (keys, values) as a query reads them."""
    kq, ks, vq, vs = kivi.quantize_page(pk, pv)
    return (kivi.dequantize_keys(kq, ks, jnp.float32),
            kivi.dequantize_values(vq, vs, jnp.float32))


_write = jax.jit(kivi.write, static_argnums=1)  # as the steps run it: one compile per shape


def _reference(q, k, v, q_pos, scale):
    """Attention of queries q [T, N, H] at q_pos over a sequence's keys k, v [S, K, H]
    (float64): each query's own page as given, earlier pages quantized by the page."""
    s_len, kv, h = k.shape
    full = s_len // PS * PS
    kd, vd = k.astype(np.float64).copy(), v.astype(np.float64).copy()
    if full:
        pk = jnp.asarray(k[:full].reshape(-1, PS, kv, h).transpose(0, 2, 1, 3))
        pv = jnp.asarray(v[:full].reshape(-1, PS, kv, h).transpose(0, 2, 1, 3))
        back_k, back_v = _round_trip(pk, pv)
        kd[:full] = np.asarray(back_k).transpose(0, 2, 1, 3).reshape(full, kv, h)
        vd[:full] = np.asarray(back_v).transpose(0, 2, 1, 3).reshape(full, kv, h)
    g = q.shape[1] // kv
    out = np.zeros(q.shape)
    for i, p in enumerate(q_pos):
        own = p // PS * PS
        keys = np.concatenate([kd[:own], k[own:p + 1]])  # [p + 1, K, H]
        vals = np.concatenate([vd[:own], v[own:p + 1]])
        for n in range(q.shape[1]):
            s = keys[:, n // g] @ q[i, n].astype(np.float64) * scale
            w = np.exp(s - s.max())
            out[i, n] = (w / w.sum()) @ vals[:, n // g]
    return out


def test_a_query_sees_its_own_page_in_float_and_earlier_pages_dequantized():
    """`kivi.write` then the reference attention, against float64 attention over exactly
    those keys and values: a prefill-shaped call over several pages and two rows of other
    lengths, then decode-shaped calls, one of which completes a page."""
    rng = np.random.default_rng(1)
    kv, h, n = CONFIG.num_kv_heads, CONFIG.head_dim, CONFIG.num_heads
    k = rng.standard_normal((2, 13, kv, h)).astype(np.float32) * 3
    v = rng.standard_normal((2, 13, kv, h)).astype(np.float32)
    q = rng.standard_normal((2, 13, n, h)).astype(np.float32)
    table = jnp.asarray(np.stack([TABLE[:8], TABLE[8:16]]))
    cache = init_cache(CONFIG, KIVI, open_rows=2)
    worst = 0.0
    # row 0: 10 tokens, then 1, then 2 (completing its third page); row 1: 7, 1 (completing
    # its second page), 2
    for lengths, t, num_new in (([0, 0], 10, [10, 7]), ([10, 7], 1, [1, 1]),
                                ([11, 8], 2, [2, 2])):
        lengths = jnp.asarray(lengths, jnp.int32)
        batch = BatchInfo(page_table=table, lengths=lengths,
                          num_new=jnp.asarray(num_new, jnp.int32),
                          open_rows=jnp.asarray([1, 0], jnp.int32))
        rows_k = jnp.stack([k[r, int(lengths[r]):int(lengths[r]) + t] for r in range(2)])
        rows_v = jnp.stack([v[r, int(lengths[r]):int(lengths[r]) + t] for r in range(2)])
        cache, fresh = _write(cache, 0, rows_k, rows_v, batch)
        rows_q = jnp.stack([q[r, int(lengths[r]):int(lengths[r]) + t] for r in range(2)])
        got = np.asarray(attention_reference(rows_q, cache, 0, batch, None, fresh=fresh))
        for r in range(2):
            end = int(lengths[r]) + num_new[r]
            pos = list(range(int(lengths[r]), end))
            want = _reference(np.asarray(rows_q[r, :len(pos)]), k[r, :end], v[r, :end], pos,
                              h ** -0.5)
            worst = max(worst, float(np.abs(got[r, :len(pos)] - want).max()))
    assert worst < 4e-6, worst  # measured 3.6e-7 (float32 against float64; values ~N(0, 1))


def _extend(p, chunks, tokens, fmt="int4_kivi", row=1):
    """Logits [T, V] of `tokens` fed in calls of `chunks` tokens to one sequence (its open
    page `row` of 3), and the cache."""
    cache = init_cache(CONFIG, with_cache(dtype=fmt), open_rows=3)
    out, at = [], 0
    for c in chunks:
        batch = BatchInfo(page_table=TABLE[None, :16], lengths=np.asarray([at], np.int32),
                          num_new=np.asarray([c], np.int32),
                          open_rows=np.asarray([row], np.int32) if fmt == "int4_kivi"
                          else None)
        logits, cache = steps.extend(p, CONFIG, cache, np.asarray([tokens[at:at + c]]),
                                     batch, plan=INVARIANT)
        out.append(np.asarray(logits[0]))
        at += c
    return np.concatenate(out), cache


@pytest.fixture(scope="module")
def p():
    return params()


TOKENS = np.random.default_rng(2).integers(1, CONFIG.vocab_size, 23).astype(np.int32)


def test_a_tokens_bits_do_not_depend_on_how_its_sequence_was_cut_into_calls(p):
    """One 23-token call, 23 one-token calls, calls of 5 + 7 + 11 (pages completed inside a
    call, at its end, and by a decode-shaped call), another open page: bitwise equal."""
    whole, _ = _extend(p, [23], TOKENS)
    for chunks, row in (([1] * 23, 1), ([5, 7, 11], 1), ([5, 7, 11], 2)):
        np.testing.assert_array_equal(_extend(p, chunks, TOKENS, row=row)[0], whole)


def test_the_first_page_is_float32_and_later_ones_move_the_logits_by_their_rounding(p):
    """Queries in the first page see only float keys: float32 pages' logits, bitwise.
    Later queries see int4 pages: close to float32 pages', not equal. The stored layer-0
    pages are float32 pages' layer-0 K/V quantized by the page (layer 0's K/V do not depend
    on the cache), and the open page holds float32 pages' tail, bitwise."""
    got, cache = _extend(p, [23], TOKENS)
    ref, ref_cache = _extend(p, [23], TOKENS, fmt="float32")
    np.testing.assert_array_equal(got[:PS], ref[:PS])
    worst = float(np.abs(got[PS:] - ref[PS:]).max())
    # measured 1.67 (logits up to 10: the tests' sharp weights magnify a rounding of K/V)
    assert 0 < worst < 17, worst
    pages = TABLE[:23 // PS]
    kq, ks, vq, vs = kivi.quantize_page(ref_cache.k[0][:, pages], ref_cache.v[0][:, pages])
    for stored, want in ((cache.k[0][:, pages], kq), (cache.k_scale[0][:, pages], ks),
                         (cache.v[0][:, pages], vq), (cache.v_scale[0][:, pages], vs)):
        np.testing.assert_array_equal(np.asarray(stored), np.asarray(want))
    tail = 23 % PS
    np.testing.assert_array_equal(np.asarray(cache.open_k[0, :, 1, :tail]),
                                  np.asarray(ref_cache.k[0, :, TABLE[23 // PS], :tail]))


def test_a_rows_bits_do_not_depend_on_the_other_rows_of_its_batch(p):
    """Two sequences of other lengths in one call per step, against each alone."""
    other = np.random.default_rng(3).integers(1, CONFIG.vocab_size, 23).astype(np.int32)
    cache = init_cache(CONFIG, KIVI, open_rows=3)
    table = np.stack([TABLE[:16], TABLE[16:32]])
    got = [[], []]
    starts = [0, 0]
    for chunks in ((9, 4), (1, 1), (8, 3), (5, 1)):
        tokens = np.zeros((2, max(chunks)), np.int32)
        for r, (seq, c) in enumerate(zip((TOKENS, other), chunks, strict=True)):
            tokens[r, :c] = seq[starts[r]:starts[r] + c]
        batch = BatchInfo(page_table=table, lengths=np.asarray(starts, np.int32),
                          num_new=np.asarray(chunks, np.int32),
                          open_rows=np.asarray([2, 0], np.int32))
        logits, cache = steps.extend(p, CONFIG, cache, tokens, batch, plan=INVARIANT)
        for r, c in enumerate(chunks):
            got[r].append(np.asarray(logits[r, :c]))
            starts[r] += c
    np.testing.assert_array_equal(np.concatenate(got[0]), _extend(p, [23], TOKENS)[0])
    np.testing.assert_array_equal(np.concatenate(got[1]), _extend(p, [9], other[:9])[0])


def test_the_engine_keeps_every_exact_promise_under_the_format(p):
    """With 10 pages, evictions and preemptions (a preempted request's open page rebuilt by
    its recompute) and freed pages poisoned: a cache-off engine's bits (cache on == off
    and alone bits: tests/test_quantized_pages.py)."""
    off = engine(p, cache=KIVI, prefix_cache=False).generate(_requests())
    tight = engine(p, cache=with_cache(KIVI, num_pages=10), poison_freed=True, max_slots=2)
    assert_same(tight.generate(_requests()), off)
    m = tight.metrics()
    assert m["evictions"] > 0 and m["preemptions"] > 0
    f32 = engine(p, prefix_cache=False).generate(_requests())
    # the prompt's last token sees int4 pages: close to float32 pages' logits, not equal
    # (measured 1.0, logits up to 10)
    first_step = max(float(np.abs(a.logits[0] - b.logits[0]).max()) for a, b in zip(
        off, f32, strict=True))
    assert 0 < first_step < 10, first_step


def test_the_format_is_part_of_the_cache_identity(p):
    r = _requests()[0]
    assert engine(p, cache=KIVI).namespace(r).differing_fields(
        engine(p, cache=with_cache(dtype="int8")).namespace(r)) == ["kv_dtype"]


def test_the_calculator_counts_the_bytes_the_pool_allocates(p):
    """int4 numbers, a float16 step and minimum per key channel per page and per value
    token, and one float32 open page per slot: what the engine's pool allocates."""
    per_token = kv_bytes(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, 1, 1,
                         kv_bytes_per_scalar("int4_kivi", CONFIG.head_dim, PS))
    open_page = 2 * CONFIG.num_layers * CONFIG.num_kv_heads * PS * CONFIG.head_dim * 4
    eng = engine(p, cache=KIVI)
    assert cache_bytes(eng.kv.target.cache) == (
        KIVI.num_pages * PS * per_token + eng.engine_config.max_slots * open_page)
    assert eng.kv.target.page_bytes == PS * per_token  # a page's bytes: the open pages apart
    # SmolLM2's head_dim 64 in pages of 16: keys 0.75, values 0.5625 bytes per number
    assert kv_bytes_per_scalar("float32", 64) / kv_bytes_per_scalar("int4_kivi", 64, 16) == (
        pytest.approx(4 / 0.65625))


def test_what_the_format_cannot_serve_yet_is_refused_with_a_reason(p):
    """Speculative decoding and partial-page copies (they would need float numbers an open
    page no longer holds), n > 1 (one open page for the samples), generate(), a mesh; the
    Pallas kernels fall back. The engine goes on serving."""
    with pytest.raises(NotImplementedError, match="speculative decoding or partial_page_copy"):
        engine(p, cache=KIVI, partial_page_copy=True)
    with pytest.raises(NotImplementedError, match="speculative decoding"):
        Engine(p, CONFIG, EngineConfig(cache=KIVI), draft=(p, CONFIG))
    eng = engine(p, cache=KIVI)
    with pytest.raises(InvalidRequestError, match="n=2 with int4_kivi"):
        eng.submit(Request(tokens=[1, 2, 3], max_new_tokens=2, n=2))
    with pytest.raises(NotImplementedError, match="generate"):
        generate(p, CONFIG, [[1, 2, 3]], 2, cache=KIVI)
    with pytest.raises(NotImplementedError, match="int4_kivi pages on a mesh"):
        engine(p, cache=KIVI, mesh="data=1,model=1")
    with pytest.raises(ValueError, match="open_rows >= 1"):
        init_cache(CONFIG, KIVI)
    with pytest.raises(ValueError, match="names its open page"):  # never open page 0 by default
        prefill_rows(p, CONFIG, init_cache(CONFIG, KIVI, open_rows=2), KIVI,
                     [PrefillRow([1, 2, 3], [4])])
    for backend in ("pallas_gpu", "pallas_tpu"):
        assert kernel_limits(backend, head_dim=128, page_size=16,
                             cache_dtype=DTYPES["int4_kivi"]) == [
            f"{backend} reads float pages; int4_kivi pages (and each row's float open page) "
            f"are read by the reference"]
    assert_same(eng.generate(_requests()[:1]), engine(p, cache=KIVI).generate(_requests()[:1]))
