"""Page formats against float32 pages on a real model and real text: what bfloat16, int8 and
float8 pages change (`kvjax bench kv_format`).

MT-Bench's first questions (their first turns, in the model's chat template), answered
greedily with `new_tokens` tokens each (the end of turn ignored, so every answer has them
all), under float32 pages and under each other format, one engine per format, the engine's
defaults otherwise (invariant numerics). Per format:
- agreement: the answer tokens before the first one that differs from float32 pages'
  answer, over all answer tokens;
- logit error: max and mean |logit - float32's| at those positions (the same history);
- teacher-forced NLL: the mean negative log-likelihood per token of float32 pages' answers,
  every position's logits read through a cache of the format (each prompt and answer
  prefilled chunk by chunk), and its difference from float32 pages';
- teacher-forced top-1 agreement: at those same positions (the same history for both), how
  often the format's argmax is float32 pages' (greedy agreement ends at the first
  difference; this counts every position);
- reuse across turns: each question asked again as a second turn (its answer in the
  history) in the same engine, which reuses the first turn's pages, and in a cache-off
  engine of the same format: the second turn's tokens and logits equal, bitwise;
- bytes per token (scales included) and the decode seconds per token: each format's engine
  decodes the same batch (`slots` requests of `decode_prompt` random tokens, `decode_tokens`
  answer tokens each), an untimed pass each, then `reps` passes with the formats taking
  turns (machine drift falls on all alike); the median of the engine's decode timer.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.cache.paged import BatchInfo, init_cache
from kvjax.config import CacheConfig, EngineConfig
from kvjax.decode import steps
from kvjax.decode.batching import page_table, pages_for
from kvjax.engine import Engine, Request
from kvjax.lab.progress import Progress
from kvjax.lab.report import emit, markdown_table, refuse, write_results
from kvjax.memory.calculator import kv_bytes, kv_bytes_per_scalar

FORMATS = ("float32", "bfloat16", "int8", "float8_e4m3fn", "int4_kivi")
PAGE = 16  # tokens per page, every engine and cache here


@dataclasses.dataclass
class Case:
    """A model, its chat template's prompts, and where its turns stop."""

    params: dict
    config: object
    prompts: list[list[int]]  # first turns, rendered
    second: list  # answer tokens -> the second turn's prompt (the answer in the history)


def engine_config(fmt: str, slots: int, context: int) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(page_size=PAGE, num_pages=max(256, slots * context
                                                                        // PAGE * 2),
                                          dtype=fmt), max_slots=slots, min_context=context)


def answers(case: Case, fmt: str, new_tokens: int, slots: int, context: int):
    """(results, the engine): every first turn answered in one engine of the format."""
    engine = Engine(case.params, case.config, engine_config(fmt, slots, context))
    requests = [Request(p, new_tokens, return_logits=True, ignore_eos=True)
                for p in case.prompts]
    return engine.generate(requests), engine


def decode_seconds(case: Case, formats, slots: int, prompt: int, new_tokens: int,
                   reps: int) -> dict[str, float]:
    """Format -> the median decode seconds per token (module docstring), cache off (every
    pass the same work)."""
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, case.config.vocab_size, prompt)]
               for _ in range(slots)]
    context = pages_for(prompt + new_tokens, PAGE) * PAGE
    engines = {fmt: Engine(case.params, case.config, dataclasses.replace(
        engine_config(fmt, slots, context), prefix_cache=False)) for fmt in formats}

    def one(engine: Engine) -> float:
        before = engine.metrics()["decode_s"]
        engine.generate([Request(p, new_tokens, ignore_eos=True) for p in prompts])
        return (engine.metrics()["decode_s"] - before) / (slots * (new_tokens - 1))

    for engine in engines.values():
        one(engine)  # compiles
    times = {fmt: [] for fmt in formats}
    for _ in range(reps):
        for fmt, engine in engines.items():
            times[fmt].append(one(engine))
    return {fmt: float(np.median(t)) for fmt, t in times.items()}


def teacher_forced_nll(case: Case, fmt: str, sequences: list[list[int]], starts: list[int],
                       chunk: int = 64) -> tuple[float, np.ndarray]:
    """(mean NLL per token of `sequences[i][starts[i]:]` given what precedes it, and the
    argmax at each of those positions), every position's logits read through a cache of
    format `fmt` (fast numerics, chunks of `chunk` tokens, one sequence at a time)."""
    longest = max(map(len, sequences))
    cc = CacheConfig(page_size=PAGE, num_pages=pages_for(longest, PAGE), dtype=fmt,
                     prefill_chunk=chunk, attn_block=chunk)
    total, count, top1 = 0.0, 0, []
    for seq, start in zip(sequences, starts, strict=True):
        cache = init_cache(case.config, cc, open_rows=1)
        table = page_table([list(range(cc.num_pages))], 1, cc.block_pages)
        logits = []
        for at in range(0, len(seq), chunk):
            part = seq[at: at + chunk]
            tokens = np.zeros((1, chunk), np.int32)
            tokens[0, :len(part)] = part
            batch = BatchInfo(page_table=table, lengths=np.array([at], np.int32),
                              num_new=np.array([len(part)], np.int32),
                              open_rows=None if cache.open_k is None else np.zeros(1, np.int32))
            lg, cache = steps.extend(case.params, case.config, cache, tokens, batch)
            logits.append(np.asarray(lg[0, :len(part)], np.float64))
        lg = np.concatenate(logits)[start - 1: len(seq) - 1]  # predicting seq[start:]
        top = lg.max(-1, keepdims=True)
        logp = lg - top - np.log(np.exp(lg - top).sum(-1, keepdims=True))
        total -= float(logp[np.arange(len(lg)), seq[start:]].sum())
        count += len(lg)
        top1.append(lg.argmax(-1))
    return total / count, np.concatenate(top1)


def measure(case: Case, formats=FORMATS, new_tokens: int = 128, slots: int = 8,
            context: int = 2048, progress: Progress | None = None, reps: int = 3,
            decode_prompt: int = 512, decode_tokens: int = 64) -> list[dict]:
    """One row per format (float32 first: the reference the others are compared with)."""
    rows, ref, ref_top1 = [], None, None
    seconds = decode_seconds(case, formats, slots, decode_prompt, decode_tokens, reps)
    for fmt in formats:
        results, engine = answers(case, fmt, new_tokens, slots, context)
        if ref is None:
            ref = results
        same, errors, means = 0, [0.0], []
        for got, want in zip(results, ref, strict=True):
            n = next((i for i, (a, b) in enumerate(zip(got.tokens, want.tokens, strict=True))
                      if a != b), len(want.tokens))
            same += n
            diff = np.abs(np.asarray(got.logits[:n + 1]) - np.asarray(want.logits[:n + 1]))
            errors.append(float(diff.max()))
            means.append(float(diff.mean()))
        sequences = [p + r.tokens for p, r in zip(case.prompts, ref, strict=True)]
        nll, top1 = teacher_forced_nll(case, fmt, sequences, [len(p) for p in case.prompts])
        ref_top1 = top1 if ref_top1 is None else ref_top1
        second = [Request(case.second(p, r.tokens), new_tokens // 4, return_logits=True,
                          ignore_eos=True) for p, r in zip(case.prompts, results, strict=True)]
        on = engine.generate(second)
        off = Engine(case.params, case.config, dataclasses.replace(
            engine_config(fmt, slots, context), prefix_cache=False)).generate(second)
        c = case.config
        rows.append({
            "format": fmt, "answers": len(results), "answer_tokens": new_tokens,
            "agreement": same / (len(results) * new_tokens),
            "max_logit_error": max(errors), "mean_logit_error": float(np.mean(means)),
            "forced_agreement": float(np.mean(top1 == ref_top1)),
            "nll": nll, "turn2_reused_tokens": sum(r.stats["reused_tokens"] for r in on),
            "turn2_same_as_cache_off": all(
                a.tokens == b.tokens and np.array_equal(a.logits, b.logits)
                for a, b in zip(on, off, strict=True)),
            "bytes_per_token": kv_bytes(c.num_layers, c.num_kv_heads, c.head_dim, 1, 1,
                                        kv_bytes_per_scalar(fmt, c.head_dim, PAGE)),
            "decode_s_per_token": seconds[fmt]})
        if progress is not None:
            progress.update()
    for r in rows:
        r["nll_diff"] = r["nll"] - rows[0]["nll"]
        r["tokens_per_byte_vs_f32"] = rows[0]["bytes_per_token"] / r["bytes_per_token"]
        r["decode_vs_f32"] = r["decode_s_per_token"] / rows[0]["decode_s_per_token"]
    return rows


COLUMNS = [
    ("pages", lambda r: r["format"]),
    ("greedy agreement", lambda r: f"{r['agreement']:.1%}"),
    ("teacher-forced top-1 agreement", lambda r: f"{r['forced_agreement']:.2%}"),
    ("max (mean) |Δlogit|", lambda r: f"{r['max_logit_error']:.3g} ({r['mean_logit_error']:.2g})"),
    ("NLL/token (Δ)", lambda r: f"{r['nll']:.4f} ({r['nll_diff']:+.4f})"),
    ("turn 2 == cache off", lambda r: "yes" if r["turn2_same_as_cache_off"] else "NO"),
    ("bytes/token", lambda r: f"{r['bytes_per_token']:,}"),
    ("tokens/byte vs f32", lambda r: f"{r['tokens_per_byte_vs_f32']:.2f}x"),
    ("decode ms/token (vs f32)",
     lambda r: f"{r['decode_s_per_token'] * 1e3:.2f} ({r['decode_vs_f32']:.2f}x)"),
]


def real_case(name: str, questions: int) -> Case:
    """`questions` MT-Bench first turns for the registered model `name`."""
    from kvjax import models
    from kvjax.data.mtbench import mtbench

    model = models.load(name)
    picked = mtbench().conversations[:questions]
    prompts = [model.template.render([{"role": "user", "content": q.user_turns[0]}])
               for q in picked]

    def second(prompt: list[int], answer: list[int]) -> list[int]:
        text = model.tokenizer.decode(answer)
        i = prompts.index(prompt)
        return model.template.render([
            {"role": "user", "content": picked[i].user_turns[0]},
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Say that again in one sentence."}])

    return Case(model.params, model.config, prompts, second)


def main(args) -> int:
    model = args.model or "smollm2-135m-instruct"
    questions = args.requests or 32
    new_tokens = args.gen_tokens or 128
    formats = tuple(args.formats.split(",")) if args.formats else FORMATS
    if formats[0] != "float32" or not set(formats) <= set(FORMATS):
        return refuse(f"--formats: float32 first, then any of {', '.join(FORMATS[1:])}")
    emit(f"bench kv_format: {model}, {questions} MT-Bench first turns x {new_tokens} greedy "
         f"tokens; pages {', '.join(formats)}")
    case = real_case(model, questions)
    with Progress(len(formats), "formats") as bar:
        rows = measure(case, formats, new_tokens=new_tokens, progress=bar, reps=args.reps)
    write_results(args.out, markdown_table(rows, COLUMNS), rows, model=model,
                  questions=questions, new_tokens=new_tokens)
    return 0
