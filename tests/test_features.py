"""The final norm's output (`forward(..., features=True)`, `Transformer(features=True)`):
what the output head reads, the input of an EAGLE-style drafter. Through `output_head` it
gives the forward pass's logits, tied or untied head, soft-capped or not."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_tokens, sharp_params, small_model

import kvjax
from kvjax.model.transformer import output_head


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": False, "final_softcap": 30.0}])
def test_features_through_the_output_head_are_the_logits(kw):
    config = small_model(**kw)
    params = sharp_params(config, seed=4)
    tokens = np.asarray(random_tokens(5, [17], config.vocab_size))
    features = kvjax.forward(params, config, tokens, features=True)
    assert features.shape == (1, 17, config.d_model)
    logits = np.asarray(kvjax.forward(params, config, tokens))
    got = np.asarray(output_head(params, config, features))
    # the same product on the same features: equal (measured 0 for both, logits up to 12)
    np.testing.assert_array_equal(got, logits)
    assert np.abs(logits).max() > 1.0
