"""Hugging Face RoPE parameters -> `ModelConfig.rope_theta` / `rope_scaling`.

transformers 5 keeps them in `rope_parameters` ({"rope_type": ..., "rope_theta": ..., and
the type's numbers}); 4.x wrote `rope_scaling` (with "type" or "rope_type") beside
`rope_theta`; Gemma 3 gives one dict per layer type ("full_attention",
"sliding_attention"). Implemented, as `transformers.modeling_rope_utils` computes them:
"default"; "linear"; "llama3"; "yarn"; "dynamic" (NTK scaling that changes the frequencies
only past `max_position_embeddings`: kvjax keeps it in the config, computes plain RoPE, and
`ModelConfig` refuses a `max_seq_len` past that point). Anything else (longrope, partial
rotary, unknown keys) is refused by name.
"""

from __future__ import annotations

import math

IMPLEMENTED = ("default", "linear", "dynamic", "llama3", "yarn")
# the numbers each type reads besides rope_type / type / rope_theta
_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
}
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
             "llama3": _KEYS["llama3"], "yarn": ()}
LAYER_TYPES = ("full_attention", "sliding_attention")


def kind_of(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def per_layer_type(rope: dict) -> bool:
    """Whether a RoPE dict holds one dict per layer type (Gemma 3) rather than one set."""
    return any(isinstance(v, dict) for v in rope.values())


def unsupported(rope) -> str | None:
    """Why one RoPE dict (or a dict per layer type) is not implemented (None: it is)."""
    if not rope:
        return None
    if not isinstance(rope, dict):
        return "not a dict"
    if per_layer_type(rope):
        if set(rope) - set(LAYER_TYPES) or not all(isinstance(v, dict) for v in rope.values()):
            return f"RoPE parameters per layer type must be dicts under {LAYER_TYPES}"
        return next((f"{t}: {why}" for t, r in rope.items() if (why := unsupported(r))), None)
    kind = kind_of(rope)
    if kind not in IMPLEMENTED:
        return f"rope type {kind!r} is not implemented (implemented: {', '.join(IMPLEMENTED)})"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings are not implemented (RoPE rotates the whole head)"
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", *_KEYS[kind]}
    if unknown := sorted(set(rope) - known):
        return f"rope type {kind!r} with {unknown} is not implemented"
    if missing := [k for k in _REQUIRED.get(kind, ()) if rope.get(k) is None]:
        return f"rope type {kind!r} needs {missing}"
    return None


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def scaling(rope: dict | None, max_positions: int, top_level: dict) -> tuple:
    """`ModelConfig.rope_scaling` of one checked RoPE dict (`unsupported` said None);
    `top_level` is the whole rope dict transformers reads yarn's `truncate` from."""
    rope = rope or {}
    kind = kind_of(rope)
    if kind == "default":
        return ()
    if kind == "dynamic":
        return (("rope_type", "dynamic"), ("factor", float(rope["factor"])),
                ("original_max_position_embeddings", float(max_positions)))
    if kind == "linear":
        return (("rope_type", "linear"), ("factor", float(rope["factor"])))
    if kind == "llama3":
        return (("rope_type", "llama3"), *((k, float(rope[k])) for k in _KEYS["llama3"]))
    original = rope.get("original_max_position_embeddings") or max_positions
    factor = rope.get("factor") or max_positions / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = (_mscale(factor, mscale) / _mscale(factor, mscale_all)
                            if mscale and mscale_all else _mscale(factor))
    return (("rope_type", "yarn"), ("factor", float(factor)),
            ("original_max_position_embeddings", float(original)),
            ("attention_factor", float(attention_factor)),
            ("beta_fast", float(rope.get("beta_fast") or 32)),
            ("beta_slow", float(rope.get("beta_slow") or 1)),
            ("truncate", bool(top_level.get("truncate", True))))


def theta_of(rope: dict | None, default) -> float:
    theta = (rope or {}).get("rope_theta", default)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ValueError(f"rope_theta={theta!r} is not a positive number")
    return float(theta)
