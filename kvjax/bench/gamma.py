"""One speculative program for every γ against a program per γ (`kvjax bench gamma`).

The n-gram drafter on the model (SmolLM2-135M-Instruct by default; `--model random`: the
config's model, random weights) with the engine's numerics, one row, a prompt that repeats
itself. Three ways to compile `spec_loop` for the γ values of `--gammas` (γ_max their
largest):
  - alone: a program per γ, verify width γ + 1 (what a fixed-γ engine compiles);
  - one: one program for every γ <= γ_max, verify widths `verify_widths(γ_max)` (γ + 1 for
    γ = 1, 2, 4, ... and γ_max; a γ between them verifies at the next width up): what an
    adaptive engine compiles;
  - padded: one program whose only verify width is γ_max + 1 (γ_max's alone program).
Each program's compile seconds (JAX's persistent cache off: XLA's own), then `--reps`
passes of `--gen-tokens` tokens with the programs taking turns (after an untimed pass
each), the medians of ms per token and their ratio to alone. The tokens must agree: a
program's widths change no bit.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from kvjax.bench import bench_model
from kvjax.cache.paged import BatchInfo, init_cache
from kvjax.config import CacheConfig, EngineConfig
from kvjax.decode import steps
from kvjax.decode.batching import page_table
from kvjax.decode.state import decode_state
from kvjax.engine import Engine
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.speculative.loop import spec_loop, verify_widths

PAGE, CHUNK = 16, 64


def prompt_tokens(vocab: int, length: int) -> list[int]:
    """A prompt that repeats a 13-token phrase: the n-gram drafter's case."""
    rng = np.random.default_rng(0)
    phrase = [int(t) for t in rng.integers(1, vocab, 13)]
    return (phrase * (length // 13 + 1))[:length]


class Setup:
    """The stored weights, plan, a prefilled cache and the call's inputs."""

    def __init__(self, params, config, prompt: list[int], tokens: int):
        model = Engine(params, config, EngineConfig(max_slots=1)).runner.model
        self.params, self.config, self.plan = model.params, config, model.plan
        context = len(prompt) + tokens + 64
        pages = -(-context // PAGE)
        cc = CacheConfig(page_size=PAGE, num_pages=pages + 1, prefill_chunk=CHUNK,
                         attn_block=CHUNK)
        table = page_table([list(range(1, pages + 1))], 1, cc.block_pages)
        cache = init_cache(config, cc)
        body = prompt[:-1]
        for start in range(0, len(body), CHUNK):
            piece = np.zeros((1, CHUNK), np.int32)
            piece[0, :len(body[start:start + CHUNK])] = body[start:start + CHUNK]
            batch = BatchInfo(table, np.array([start], np.int32),
                              np.array([len(body[start:start + CHUNK])], np.int32))
            cache = steps.extend(self.params, config, cache, piece, batch, plan=self.plan)[1]
        self.prefilled = cache  # the prompt's K/V, copied into each call (donated)
        self.state = decode_state(table, np.array([len(body)], np.int32),
                                  np.array([prompt[-1]], np.int32),
                                  np.array([tokens], np.int32), np.zeros((1, 2), np.uint32))
        self.history = np.zeros((1, -(-context // 64) * 64), np.int32)
        self.history[0, :len(prompt)] = prompt
        self.tokens = tokens

    def args(self, gamma: int, gamma_max: int, widths) -> tuple[tuple, dict]:
        return ((self.params, self.config, jax.tree.map(lambda x: x.copy(), self.prefilled),
                 self.state),
                dict(drafter="ngram", gamma=gamma, gamma_max=gamma_max, widths=widths,
                     max_out=self.tokens, history=self.history, plan=self.plan,
                     sampled=False))

    def compile(self, gamma_max: int, widths) -> tuple[object, float]:
        """(the compiled program, its lowering and compile seconds)."""
        args, kwargs = self.args(1, gamma_max, widths)
        start = time.perf_counter()
        compiled = spec_loop.lower(*args, **kwargs).compile()
        return compiled, time.perf_counter() - start

    def run(self, compiled, gamma: int, gamma_max: int, widths) -> tuple[float, list[int]]:
        """(seconds, the tokens) of one pass."""
        (params, _, cache, state), kwargs = self.args(gamma, gamma_max, widths)
        start = time.perf_counter()
        out = compiled(params, cache, state, gamma=gamma, history=kwargs["history"])[0]
        tokens = np.asarray(out.tokens)[0].tolist()  # waits for the result
        return time.perf_counter() - start, tokens


def measure(setup: Setup, gammas: list[int], reps: int) -> list[dict]:
    """One row per γ (module docstring)."""
    top = max(gammas)
    programs = {("one",): (top, verify_widths(top)), ("padded",): (top, (top + 1,))}
    programs.update({("alone", g): (g, (g + 1,)) for g in gammas})
    compiled, seconds = {}, {}
    for key, (gamma_max, widths) in programs.items():
        if key == ("alone", top):  # the padded program itself
            compiled[key], seconds[key] = compiled["padded",], seconds["padded",]
            continue
        compiled[key], seconds[key] = setup.compile(gamma_max, widths)
        emit(f"compiled {' '.join(map(str, key))}: {seconds[key]:.1f} s")
    rows = []
    for g in gammas:
        ways = {"alone": ("alone", g), "one": ("one",), "padded": ("padded",)}
        tokens = {w: setup.run(compiled[k], g, *programs[k])[1] for w, k in ways.items()}
        if len({tuple(t) for t in tokens.values()}) != 1:
            raise AssertionError(f"γ {g}: the programs' tokens differ")
        times = {w: [] for w in ways}
        for _ in range(reps):
            for w, k in ways.items():
                times[w].append(setup.run(compiled[k], g, *programs[k])[0])
        ms = {w: 1e3 * float(np.median(t)) / setup.tokens for w, t in times.items()}
        rows.append({"gamma": g, "alone compile s": seconds["alone", g],
                     **{f"{w} ms": ms[w] for w in ways},
                     "one / alone": ms["one"] / ms["alone"],
                     "padded / alone": ms["padded"] / ms["alone"]})
    rows.append({"gamma": "all", "alone compile s": sum(seconds["alone", g] for g in gammas),
                 "one compile s": seconds["one",], "padded compile s": seconds["padded",]})
    return rows


def _f(key: str, digits: int):
    return lambda r: "" if key not in r else f"{r[key]:.{digits}f}"


COLUMNS = [("γ", lambda r: str(r["gamma"])), ("compile s alone", _f("alone compile s", 1)),
           ("one", _f("one compile s", 1)), ("padded", _f("padded compile s", 1)),
           ("ms/token alone", _f("alone ms", 2)), ("one", _f("one ms", 2)),
           ("padded", _f("padded ms", 2)), ("one / alone", _f("one / alone", 3)),
           ("padded / alone", _f("padded / alone", 3))]


def main(args) -> int:
    jax.config.update("jax_enable_compilation_cache", False)  # time XLA, not a cache read
    params, config, name = bench_model(args)
    gammas = [int(x) for x in args.gammas.split(",")]
    emit(f"spec_loop programs for γ {gammas}: {name}, n-gram drafter, one row, "
         f"{args.gen_tokens} tokens a pass, {args.reps} reps, medians")
    setup = Setup(params, config, prompt_tokens(config.vocab_size, args.prompt_len),
                  args.gen_tokens)
    rows = measure(setup, gammas, args.reps)
    write_results(args.out, markdown_table(rows, COLUMNS), rows, model=name,
                  gen_tokens=args.gen_tokens, prompt_len=args.prompt_len)
    return 0
