"""An EAGLE head's rows keep their bits at every row count (issue: a host whose XLA picks
another kernel for the head's fusion product broke the head-page promise of
tests/test_engine_eagle.py). The head's pairs computed in one call of many rows, in a call
per sequence, and one pair per call (a lone row, as a catch-up of one accepted token
writes it) give every pair the same K/V pages, predicted features and draft
log-probabilities, bitwise, under the plans an engine chooses at start-up: XLA's products
in probed row blocks, and kvjax's CPU kernel. Two widths: the engine tests' (D = 32, whose
64 -> 32 fusion XLA kept invariant up to 33 rows on the AMD EPYC host, not at 64, and not
at the engine tests' row counts on an Intel AMX host) and SmolLM2's (D = 576, whose lone
row XLA computes by another kernel than two rows). Seen failing on the AMD host with the
fusion (every case) or the draft logits' product on XLA's own choice, and with
`jax.nn.log_softmax`'s sum (every case). And the start-up probe names the head's products where they
do not hold.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import gather_sequence, small_model

from kvjax import Engine
from kvjax.cache.identity import model_fingerprint
from kvjax.cache.paged import BatchInfo, init_cache
from kvjax.config import CacheConfig, EngineConfig, SpecConfig
from kvjax.cpu.product import kernel
from kvjax.engine import plans
from kvjax.model import tiled
from kvjax.model.layout import store
from kvjax.model.transformer import init_params
from kvjax.speculative.eagle import (
    draft_head,
    head_config,
    head_extend,
    head_products,
    init_head,
)
from kvjax.speculative.eagle_file import HeadFile

SEQS, LENGTH, VOCAB = 4, 24, 40  # 96 rows in the batched call
TOP_K = VOCAB  # the whole draft distribution, sorted
CACHE = CacheConfig(page_size=4, num_pages=SEQS * LENGTH // 4, prefill_chunk=16,
                    attn_block=2)
PAGES = LENGTH // 4  # per sequence: 3 attention blocks, so the loop is never specialised
WIDTHS = {"32": small_model(), "576": small_model(d_model=576, num_heads=9, num_kv_heads=3,
                                                  d_ff=128)}
needs_kernel = pytest.mark.skipif(not kernel().available, reason=kernel().describe())


def engine_plan(config, cpu_kernel: str):
    """The head's plan an EAGLE engine chooses at start-up (`numerics_plans` with the
    head's products), and the problems it found."""
    ec = EngineConfig(cache=CACHE, max_slots=SEQS, cpu_kernel=cpu_kernel)
    _, head_plan, problems = plans.numerics_plans(
        [config, head_config(config)], ec, 8, extra=[{}, head_products(config, VOCAB)])
    return head_plan, problems


def _run(config, plan, head, target, w, cache, seqs, start, count, features, tokens):
    """head_extend over sequences `seqs`, their pairs [start, start + count): (best,
    columns, predictions) of those pairs, and the cache."""
    table = np.stack([np.arange(s * PAGES, (s + 1) * PAGES, dtype=np.int32) for s in seqs])
    n = len(seqs)
    batch = BatchInfo(table, np.full(n, start, np.int32), np.full(n, count, np.int32))
    out, cache = head_extend(head, target, config, cache,
                             features[seqs, start:start + count],
                             tokens[seqs, start:start + count], batch, w, TOP_K, plan)
    return [np.asarray(a) for a in out], cache


@pytest.mark.parametrize("cpu_kernel", ["off", pytest.param("auto", marks=needs_kernel)])
@pytest.mark.parametrize("width", list(WIDTHS))
def test_the_head_s_pairs_have_their_bits_at_every_row_count(width, cpu_kernel):
    config = WIDTHS[width]
    plan, problems = engine_plan(config, cpu_kernel)
    assert problems == []
    assert plan.cpu_kernel == (cpu_kernel == "auto")
    if not plan.cpu_kernel:  # the head's own products are in the plan
        assert {"eagle fc", "eagle logits"} <= set(dict(plan.row_blocks))
    target = init_params(config, seed=1)
    head = store(init_head(config, seed=2), plan)
    w = draft_head(target, config, np.arange(VOCAB, dtype=np.int32) + 3)
    rng = np.random.default_rng(0)
    features = rng.normal(size=(SEQS, LENGTH, config.d_model)).astype(np.float32) * 3
    tokens = rng.integers(0, config.vocab_size, (SEQS, LENGTH)).astype(np.int32)
    everyone = list(range(SEQS))

    def fresh():
        return init_cache(head_config(config), CACHE)

    together, batched = _run(config, plan, head, target, w, fresh(), everyone, 0, LENGTH,
                             features, tokens)
    alone, lone = [], fresh()  # each sequence in its own call, then pair by pair
    for s in range(SEQS):
        out, lone = _run(config, plan, head, target, w, lone, [s], 0, LENGTH, features,
                         tokens)
        alone.append(out)
    single, pairs = [], fresh()
    for s in range(SEQS):
        steps = []
        for t in range(LENGTH):
            out, pairs = _run(config, plan, head, target, w, pairs, [s], t, 1, features,
                              tokens)
            steps.append(out)
        single.append([np.concatenate(parts, axis=1) for parts in zip(*steps, strict=True)])
    for s in range(SEQS):
        pages = list(range(s * PAGES, (s + 1) * PAGES))
        want = gather_sequence(batched, pages, LENGTH)
        for other in (lone, pairs):
            for got_kv, want_kv in zip(gather_sequence(other, pages, LENGTH), want,
                                       strict=True):
                np.testing.assert_array_equal(got_kv, want_kv)
        for got in (alone[s], single[s]):
            for a, b in zip(got, together, strict=True):  # best, columns, predictions
                np.testing.assert_array_equal(a[0], b[s])
    assert np.abs(want[0]).max() > 0.1  # pages written, not zeros


def test_the_start_up_probe_names_the_head_s_products_where_they_fail(monkeypatch):
    """An EAGLE engine's start-up probes the head's products with its layer's: their row
    blocks are in the head's plan; on a backend where no block keeps the fusion product's
    rows (stood in for by the probes' answer for that shape) the engine warns naming
    "eagle fc", and the target's plan is unaffected."""
    config = small_model(d_ff=96)  # the fusion's [64, 32] is no layer product's shape
    target = init_params(config, seed=1)
    vocab = np.arange(VOCAB, dtype=np.int32) + 3
    head = HeadFile(init_head(config, seed=2), vocab, model_fingerprint(config, target),
                    "head", {})
    ec = EngineConfig(cache=CACHE, max_slots=SEQS, cpu_kernel="off", min_context=96)
    spec = SpecConfig(drafter="eagle", gamma=3, tree_nodes=8, branches=3)
    engine = Engine(target, config, ec, spec=spec, draft=head)
    assert engine.numerics_problems == []
    assert {"eagle fc", "eagle logits"} <= set(dict(engine.spec.plan.row_blocks))
    assert not {"eagle fc", "eagle logits"} & set(dict(engine.plan.row_blocks))

    fc_shape = head_products(config, VOCAB)["eagle fc"][0]
    whole, block = tiled._probe_whole, tiled._probe_dot

    def refuse(probe):
        return lambda shape, *rest: shape != fc_shape and probe(shape, *rest)

    monkeypatch.setattr(tiled, "_probe_whole", refuse(whole))
    monkeypatch.setattr(tiled, "_probe_dot", refuse(block))
    with pytest.warns(RuntimeWarning, match="does not hold on this backend for: eagle fc"):
        engine = Engine(target, config, ec, spec=spec, draft=head)
    assert engine.numerics_problems == ["eagle fc"]
    with pytest.warns(RuntimeWarning, match="eagle fc"):
        _, problems = engine_plan(config, "off")
    assert problems == ["eagle fc"]
