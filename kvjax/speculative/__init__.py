"""Speculative decoding, the public face: drafters, acceptance rules, the speedup model.

Serving: `kvjax.Engine(params, config, engine_config, draft=(draft_params, draft_config),
spec=SpecConfig(drafter="model" | "ngram", gamma, adaptive))` runs the on-device loop
(`kvjax.speculative.loop`). Research drafters that implement the `Drafter` protocol run
in the host-driven `speculative_generate(target_params, target_config, prompts,
max_new_tokens, drafter, gamma)`, whose rollback is bitwise a fresh prefill. Both paths
count with one `SpecStats` and choose adaptive γ with one `GammaPolicy`. Token trees:
`tree_generate(params, config, prompts, max_new_tokens, tree_drafter, max_nodes)` verifies a
tree per target call from the host (greedy bitwise plain decoding under invariant numerics;
sampled exact).

The parts: rules.py (acceptance rules, speedup model), stats.py, gamma.py, loop.py (the
device loop), ngram_device.py, drafters.py + host.py (the host Drafter path), plugin.py
(the engine's draft pool and γ controller), cost.py (measured c and verify slope),
operating_point.py (the measurement `kvjax bench spec` and the experiments share),
tree.py (tree arrays, acceptance over a tree, the n-gram tree drafter), tree_model.py (a
draft model's trees), tree_host.py (tree_generate).

The names from drafters, host and rules load on first use (PEP 562 `__getattr__`): they
import JAX, and `gamma` and `stats` are host code that must import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax import lazy as _lazy
from kvjax.config import SpecConfig
from kvjax.speculative.gamma import GammaPolicy, choose_gamma
from kvjax.speculative.stats import SpecStats

# module -> names, loaded on first use
_EXPORTS = {
    "kvjax.speculative.drafters": ("Drafter", "ModelDrafter", "NGramDrafter", "make_drafter"),
    "kvjax.speculative.host": ("SpecResult", "speculative_generate"),
    "kvjax.speculative.rules": ("greedy_accept", "predicted_speedup", "sampling_accept"),
    "kvjax.speculative.tree": ("NGramTreeDrafter", "greedy_path", "sampled_path",
                               "tree_arrays"),
    "kvjax.speculative.tree_host": ("TreeResult", "tree_generate"),
    "kvjax.speculative.tree_model": ("ModelTreeDrafter",),
}

__all__ = ["Drafter", "GammaPolicy", "ModelDrafter", "ModelTreeDrafter", "NGramDrafter",
           "NGramTreeDrafter",
           "SpecConfig", "SpecResult", "SpecStats", "TreeResult", "choose_gamma",
           "greedy_accept", "greedy_path", "make_drafter", "predicted_speedup",
           "sampled_path", "sampling_accept", "speculative_generate", "tree_arrays",
           "tree_generate"]

if TYPE_CHECKING:  # what static tools read: the names of _EXPORTS (tests/test_layout.py)
    from kvjax.speculative.drafters import Drafter, ModelDrafter, NGramDrafter, make_drafter
    from kvjax.speculative.host import SpecResult, speculative_generate
    from kvjax.speculative.rules import greedy_accept, predicted_speedup, sampling_accept
    from kvjax.speculative.tree import (
        NGramTreeDrafter,
        greedy_path,
        sampled_path,
        tree_arrays,
    )
    from kvjax.speculative.tree_host import TreeResult, tree_generate
    from kvjax.speculative.tree_model import ModelTreeDrafter

_getattr, __dir__ = _lazy.exports(__name__, _EXPORTS)


def __getattr__(name: str):
    return _getattr(name)
