"""The KV memory calculator and the cost explorer."""

from __future__ import annotations

import jax
import numpy as np

import kvjax
from kvjax import CacheConfig, ModelConfig, memory
from kvjax.model.transformer import param_shapes

LLAMA_8B = ModelConfig(vocab_size=128256, num_layers=32, d_model=4096, num_heads=32,
                       num_kv_heads=8, d_ff=14336, max_seq_len=8192, rope_theta=500000.0,
                       tie_embeddings=False)


def test_kv_bytes_per_token_for_an_8b_shape():
    assert memory.kv_bytes(32, 8, 128, length=1, bytes_per_scalar=2) == 131_072
    assert memory.kv_bytes(32, 8, 128, length=1, batch=16, bytes_per_scalar=2) == 2 * 2**20


def test_calculator_equals_physical_bytes_of_a_cache_built_from_the_same_numbers():
    for dtype, nbytes in (("bfloat16", 2), ("float32", 4)):
        cache_cfg = CacheConfig(page_size=16, num_pages=64, dtype=dtype)
        shape = jax.eval_shape(lambda c=cache_cfg: kvjax.init_cache(LLAMA_8B, c))
        # 64 pages of 16 tokens = 4 sequences of 256 tokens.
        assert kvjax.cache_bytes(shape) == memory.kv_bytes(32, 8, 128, length=256, batch=4,
                                                           bytes_per_scalar=nbytes)


def test_page_rounded_figure():
    exact = memory.kv_bytes(2, 2, 8, length=17, batch=3, bytes_per_scalar=4)
    paged = memory.kv_bytes_paged(2, 2, 8, length=17, page_size=16, batch=3,
                                  bytes_per_scalar=4)
    assert paged == exact * 32 // 17


def test_parameter_count_matches_an_8b_model_built_without_memory():
    shapes = jax.eval_shape(lambda: kvjax.init_params(LLAMA_8B, seed=0))
    counted = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
    assert counted == memory.num_params(LLAMA_8B) == 8_030_261_248


def test_parameter_count_for_every_block_choice():
    for kw in ({}, {"norm": "layer", "mlp": "gelu", "position": "learned"},
               {"qkv_bias": True, "tie_embeddings": False},
               {"o_bias": True, "mlp_bias": True}, {"mlp_bias": True, "mlp": "gelu"},
               {"mlp": "geglu", "sandwich_norms": True, "qk_norm": True}):  # Gemma 3
        config = ModelConfig(vocab_size=50, num_layers=2, d_model=16, num_heads=4,
                             num_kv_heads=2, d_ff=24, max_seq_len=32, **kw)
        params = param_shapes(config)  # the shapes init_params makes, nothing computed
        counted = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
        assert counted == memory.num_params(config), kw


def test_prefill_is_compute_bound_and_decode_bandwidth_bound_on_an_h100():
    peak, bandwidth = 989e12, 3.35e12
    prefill = memory.step_cost(LLAMA_8B, batch=1, context=0, new_tokens=2048, param_bytes=2,
                               kv_bytes_per_scalar=2)
    decode = memory.step_cost(LLAMA_8B, batch=1, context=4096, new_tokens=1, param_bytes=2,
                              kv_bytes_per_scalar=2)
    assert prefill.bound(peak, bandwidth) == "compute-bound"
    assert decode.bound(peak, bandwidth) == "bandwidth-bound"
    # Decode reads every matmul weight once (2 bytes each) plus 4096 tokens of KV.
    weights = memory.num_params(LLAMA_8B) - LLAMA_8B.vocab_size * LLAMA_8B.d_model \
        - LLAMA_8B.d_model * (2 * 32 + 1)
    assert decode.weight_bytes == 2 * weights
    assert decode.kv_read_bytes == 4097 * 131_072
    assert decode.flops > 2 * weights
    assert decode.intensity < 2


def test_sliding_window_caps_kv_read():
    config = ModelConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                         sliding_window=128, max_seq_len=8192)
    cost = memory.step_cost(config, batch=2, context=4000, new_tokens=1)
    per_token = memory.kv_bytes(2, 2, 16, 1, 1, 4)
    assert cost.kv_read_bytes == 2 * 128 * per_token


def test_the_pages_a_sliding_layer_could_free():
    """Gemma 3 270M's layout (5 sliding layers of window 512 per full one): the next token
    at position L reads keys from L - 511 on, so only pages wholly before that count; none
    below the window, none in a full layer."""
    c = ModelConfig(vocab_size=64, num_layers=18, d_model=64, num_heads=4, num_kv_heads=1,
                    d_ff=64, max_seq_len=8192, sliding_window=512,
                    layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding"
                                      for i in range(18)))
    got = memory.windowed_pages(c, 620, 16)
    assert got == {"pages_per_layer": 39, "layers": 18, "sliding_layers": 15,
                   "freeable_per_sliding_layer": 6, "freeable_layer_pages": 90,
                   "layer_pages": 702}
    # position 527 reads keys 16.. on: page 0 (keys 0-15) is dead; at 526, key 15 is live
    assert memory.windowed_pages(c, 527, 16)["freeable_per_sliding_layer"] == 1
    assert memory.windowed_pages(c, 526, 16)["freeable_per_sliding_layer"] == 0
    assert memory.windowed_pages(c, 4096, 16)["freeable_layer_pages"] == 15 * 224
    full = ModelConfig(vocab_size=64, num_layers=2, d_model=64, num_heads=4, num_kv_heads=1,
                       d_ff=64, max_seq_len=8192)
    assert memory.windowed_pages(full, 4096, 16)["freeable_layer_pages"] == 0


def test_report_labels_its_assumptions():
    text = memory.report(LLAMA_8B, batch=16, context=4096, page_size=16, kv_bytes_per_scalar=2,
                         param_bytes=2, prefill_tokens=2048, peak_flops=989e12,
                         bandwidth=3.35e12)
    assert "int8 and float8 pages count their scales in bytes/scalar (1 + 4 / head_dim)" in text
    assert "excludes page-table overhead, allocator rounding" in text
    assert "2.00 MiB" in text  # per generated token at batch 16
    assert "131,072 B" in text
    assert "bandwidth-bound" in text
    assert "compute-bound" in text
