"""`kvjax.cache.identity.digest_tree`, behind every model fingerprint: device weights are
hashed once per set of arrays (they cannot change), numpy weights at every call (they can,
in place), and the digest is the same either way."""

from __future__ import annotations

import jax
import numpy as np
from helpers import small_model

import kvjax
from kvjax.cache import identity
from kvjax.cache.identity import digest_tree


def test_device_weights_are_hashed_once_and_numpy_weights_every_time(monkeypatch):
    params = kvjax.init_params(small_model(), seed=0)
    leaves = len(jax.tree_util.tree_leaves(params))
    hashed = []
    real = np.ascontiguousarray

    def spy(a):
        hashed.append(a.shape)
        return real(a)

    monkeypatch.setattr(identity.np, "ascontiguousarray", spy)
    first = digest_tree(params)
    assert len(hashed) == leaves
    assert digest_tree(params) == first and len(hashed) == leaves  # the same arrays: cached
    copies = jax.tree_util.tree_map(lambda x: x + 0, params)  # other arrays, same values
    assert digest_tree(copies) == first and len(hashed) == 2 * leaves
    changed = jax.tree_util.tree_map(lambda x: x, params)
    changed["final_norm"]["scale"] = changed["final_norm"]["scale"].at[0].add(1)
    assert digest_tree(changed) != first
    on_host = jax.tree_util.tree_map(np.array, params)  # numpy: hashed at every call
    hashed.clear()
    assert digest_tree(on_host) == digest_tree(on_host) == first
    assert len(hashed) == 2 * leaves
    on_host["final_norm"]["scale"][0] += 1  # in place: the digest follows
    assert digest_tree(on_host) == digest_tree(changed)


def test_a_reused_id_is_not_taken_for_the_array_it_named(monkeypatch):
    """Python reuses a freed array's id for the next array: every id the same here, as if
    each leaf of `other` took the id of `params`' leaf at its path."""
    params = kvjax.init_params(small_model(), seed=0)
    other = jax.tree_util.tree_map(lambda x: x + 1, params)
    monkeypatch.setattr(identity, "id", lambda _: 0, raising=False)
    first = digest_tree(params)
    assert digest_tree(other) != first
    assert digest_tree(params) == first
