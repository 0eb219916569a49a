"""Speculative decoding, the public face: drafters, acceptance rules, the speedup model.

Serving: `kvjax.Engine(params, config, engine_config, draft=(draft_params, draft_config),
spec=SpecConfig(drafter="model" | "ngram", gamma, adaptive))` runs the on-device loop
(`kvjax.speculative.loop`). Research drafters that implement the `Drafter` protocol run
in the host-driven `speculative_generate(target_params, target_config, prompts,
max_new_tokens, drafter, gamma)`, whose rollback is bitwise a fresh prefill. Both paths
count with one `SpecStats` and choose adaptive γ with one `GammaPolicy`.

The parts: rules.py (acceptance rules, speedup model), stats.py, gamma.py, loop.py (the
device loop), ngram_device.py, drafters.py + host.py (the host Drafter path), plugin.py
(the engine's draft pool and γ controller), cost.py (measured c and verify slope),
operating_point.py (the measurement `kvjax bench spec` and the experiments share).
"""

from __future__ import annotations

from kvjax.config import CacheConfig, SamplingConfig, SpecConfig
from kvjax.speculative.drafters import Drafter, ModelDrafter, NGramDrafter
from kvjax.speculative.gamma import GammaPolicy, choose_gamma
from kvjax.speculative.host import SpecResult, speculative_generate
from kvjax.speculative.rules import greedy_accept, predicted_speedup, sampling_accept
from kvjax.speculative.stats import SpecStats


def make_drafter(spec: SpecConfig, draft: tuple | None = None,
                 cache: CacheConfig | None = None,
                 sampling: SamplingConfig | None = None) -> Drafter:
    """The drafter a SpecConfig names; `draft=(params, config)` for the model drafter."""
    if spec.drafter == "ngram":
        return NGramDrafter(max_ngram=spec.ngram_max)
    if draft is None:
        raise ValueError("the model drafter needs draft=(draft_params, draft_config)")
    return ModelDrafter(draft[0], draft[1], cache or CacheConfig(), sampling)


__all__ = ["Drafter", "GammaPolicy", "ModelDrafter", "NGramDrafter", "SpecConfig", "SpecResult",
           "SpecStats", "choose_gamma", "greedy_accept", "make_drafter", "predicted_speedup",
           "sampling_accept", "speculative_generate"]
