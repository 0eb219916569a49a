"""Training windows of the target's own answers (self-distillation) for an EAGLE-style head.

ShareGPT's recorded answers are another model's text: at a recorded token the target's
feature is its state after a token it would often not have chosen. When serving greedy, the
head drafts after the target's own choices only. So here each conversation's first user turn
is rendered as a prompt and the target answers it, greedy, through the engine (continuous
batching, fast numerics, the CPU kernels where they run); a window is the prompt and that
answer. Medusa-2 and EAGLE-3 report the same remedy for a draft trained on text that is not
the target's. The answers are the slow part (a decode step per token): they are kept in
`answers.npz` beside the head, with a digest of the prompts, the length and the target, and
reused while those match.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from kvjax.train.npz_cache import load_or_make

# a prompt longer than this share of the window leaves too little room for an answer
PROMPT_SHARE = 0.5
BATCH = 48  # decode rows: a step of 48 rows costs ~8x one row's (the weights read once)


def prompts_of(model, conversations, seq_len: int, limit: int | None = None
               ) -> list[list[int]]:
    """Each conversation's first user turn (and a system turn before it) rendered as a
    prompt for the target's answer, those of at most `seq_len * PROMPT_SHARE` tokens; the
    first `limit` of them (rendering stops there)."""
    out = []
    for c in conversations:
        if limit is not None and len(out) == limit:
            break
        messages = c.messages
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        ids = model.template.render(messages[:first + 1], add_generation_prompt=True)
        if len(ids) <= seq_len * PROMPT_SHARE:
            out.append(ids)
    return out


def _digest(prompts: list[list[int]], seq_len: int, target: str, stops) -> str:
    """What the answers depend on: the prompts, the window, the target and its stop tokens
    (and the engine's settings here: greedy, fast numerics)."""
    h = hashlib.sha256(f"{seq_len} {target} {sorted(stops)} greedy fast".encode())
    for p in prompts:
        h.update(np.asarray(p, np.int32).tobytes() + b"|")
    return h.hexdigest()


def answer(model, prompts: list[list[int]], seq_len: int, log=print) -> list[list[int]]:
    """The target's greedy answer to each prompt, up to the window's end (`seq_len + 1`
    tokens in all) or its stop token (kept)."""
    import kvjax
    from kvjax.config import CacheConfig, EngineConfig
    from kvjax.decode.batching import pages_for
    from kvjax.lab.progress import Progress

    page = 16
    # every prompt prefilled when admitted (prefill_calls_per_round=0): with the default
    # one chunk per round, a batch of BATCH prompts decodes ~BATCH rounds mostly empty;
    # one page-table width (min_context) for every step
    config = EngineConfig(cache=CacheConfig(page_size=page, num_pages=BATCH * pages_for(
        seq_len + 1, page) + 8), max_slots=BATCH, numerics="fast", prefix_cache=False,
        prefill_calls_per_round=0, min_context=seq_len + 1)
    engine = kvjax.Engine(model.params, model.config, config, eos_tokens=model.stop_tokens)
    log(f"own answers: {len(prompts)} prompts, greedy, {engine.products}")
    answers = []
    with Progress(len(prompts), "answers") as bar:
        for start in range(0, len(prompts), 4 * BATCH):
            part = prompts[start:start + 4 * BATCH]
            results = engine.generate([kvjax.Request(p, seq_len + 1 - len(p)) for p in part])
            answers += [list(r.tokens) for r in results]
            bar.update(len(part), tokens=sum(map(len, answers)))
    return answers


def own_windows(model, conversations, seq_len: int, target: str, folder: Path, limit: int,
                log=print) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int32[limit, seq_len + 1], real, answers bool[limit, seq_len + 1]) as
    `eagle_run.windows` gives them, of the first `limit` prompts `prompts_of` keeps and the
    target's own answers to them (`target`: the target's fingerprint; the answers cached in
    `folder/answers.npz`)."""
    prompts = prompts_of(model, conversations, seq_len, limit)
    if len(prompts) < limit:
        raise ValueError(f"{limit} prompts of at most {seq_len * PROMPT_SHARE:.0f} tokens "
                         f"asked for; {len(prompts)} of {len(conversations)} conversations "
                         f"have one")
    file = Path(folder) / "answers.npz"

    def make():
        made = answer(model, prompts, seq_len, log)
        return {"ends": np.cumsum([len(a) for a in made]),
                "tokens": np.asarray([t for a in made for t in a], np.int32)}

    saved, loaded = load_or_make(file, _digest(prompts, seq_len, target, model.stop_tokens),
                                 make)
    flat, ends = saved["tokens"], saved["ends"]
    answers = [flat[a:b].tolist() for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    if loaded:
        log(f"own answers: {len(answers)} from {file}")
    tokens = np.zeros((len(prompts), seq_len + 1), np.int32)
    real, said = np.zeros(tokens.shape, bool), np.zeros(tokens.shape, bool)
    for row, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        ids = (p + a)[:seq_len + 1]
        tokens[row, :len(ids)], real[row, :len(ids)] = ids, True
        said[row, len(p):len(ids)] = True
    return tokens, real, said
