"""kvjax against llama.cpp on a `kvjax.models` checkpoint: greedy tokens and logits.

    python -m kvjax.bench.llamacpp_check --model gemma3-270m [--tokens 64]

Eight short text prompts (BOS as the file says), `--tokens` greedy tokens each through the
kvjax Engine (8 slots, default invariant numerics, no stop ids) and through llama.cpp on
the float32 GGUF of the same tensors (`kvjax.bench.llamacpp`: its own environment, built
on first use); per prompt, whether the tokens are equal and the largest |logit| difference
between `kvjax.forward` and llama.cpp over the steps that chose llama.cpp's tokens.
llama.cpp keeps its KV cache in float16 by default, which bounds the agreement.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

PROMPTS = ["The capital of France is", "def fibonacci(n):\n",
           "Once upon a time, in a small village,", "The three primary colors are",
           "Water boils at", "import numpy as np\n\nx =", "A haiku about the sea:\n",
           "Question: What is 12 times 7?\nAnswer:"]


def main(argv=None) -> int:
    import kvjax
    from kvjax import models
    from kvjax.bench import llamacpp
    from kvjax.lab.report import emit
    from kvjax.model.transformer import forward

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a kvjax.models name")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    model = models.load(args.model)
    prompts = [model.tokenizer.encode_prompt(p) for p in PROMPTS]
    engine = kvjax.Engine(model.params, model.config, kvjax.EngineConfig(max_slots=8))
    ours = [r.tokens for r in engine.generate([kvjax.Request(p, args.tokens) for p in prompts])]
    python = llamacpp.environment(Path(".venv-llamacpp"), echo=emit)
    src = models.path(args.model)
    f32 = llamacpp.f32_gguf(src, Path.home() / ".cache" / "kvjax" / f"{src.stem}.f32.gguf")
    equal, worst = 0, 0.0
    for text, prompt, tokens in zip(PROMPTS, prompts, ours, strict=True):
        with tempfile.TemporaryDirectory() as tmp:
            saved = Path(tmp) / "logits.npy"
            (got,) = llamacpp.run(python, f32, [prompt], args.tokens, 1, args.threads,
                                  logits=saved)
            theirs = np.load(saved)
        ids = np.asarray([prompt + got["tokens"][:-1]])
        mine = np.asarray(forward(model.params, model.config, ids))[0, len(prompt) - 1:]
        diff = float(np.abs(mine - theirs).max())
        equal += got["tokens"] == tokens
        worst = max(worst, diff)
        emit(f"{text!r}: tokens {'equal' if got['tokens'] == tokens else 'DIFFER'}, "
              f"max |logit diff| {diff:.3g}")
    emit(f"{args.model}: {equal}/{len(PROMPTS)} prompts with equal greedy tokens over "
          f"{args.tokens}; max |logit diff| {worst:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
