"""The tests' EAGLE-style head: trained once per test run on Markov text for the engine
tests' target (`engine_helpers.CONFIG`, seed 1), whichever test process needs it first (a
lock in the run's shared temporary folder: pytest-xdist's workers share it); every other
use loads the saved head."""

from __future__ import annotations

import fcntl
import json
import os

import numpy as np
from engine_helpers import CONFIG

from kvjax.config import TrainConfig
from kvjax.model.transformer import init_params
from kvjax.speculative.eagle_file import load_head
from kvjax.train.eagle import train_head

_HELD: dict = {}  # this process's: {"result": ...}


def markov(n: int, length: int, vocab: int, seed: int) -> np.ndarray:
    """Windows of a chain whose next token is (5x + 3) mod vocab 80% of the time."""
    rng = np.random.default_rng(seed)
    out = np.zeros((n, length), np.int32)
    out[:, 0] = rng.integers(0, vocab, n)
    for t in range(1, length):
        follow = (5 * out[:, t - 1] + 3) % vocab
        out[:, t] = np.where(rng.random(n) < 0.8, follow, rng.integers(0, vocab, n))
    return out


def train(folder, stop_after: int | None = None) -> dict:
    """`train_head`'s result for the target, 80 steps (evaluated every 20, a checkpoint
    every 40) into `folder`; `stop_after` stops early (a resume continues it)."""
    target = init_params(CONFIG, seed=1)  # features of order 1, as a trained model's
    tokens = markov(48, 33, CONFIG.vocab_size, 0)
    held = markov(8, 33, CONFIG.vocab_size, 1)
    schedule = TrainConfig(steps=80, batch_size=8, learning_rate=3e-3, warmup_steps=5,
                           eval_every=20, checkpoint_every=40, seed=0)
    return train_head(target, CONFIG, (tokens, np.ones(tokens.shape, bool)),
                      (held, np.ones(held.shape, bool)), schedule, 48, folder, keep=(0,),
                      log=lambda *_: None, progress=False, stop_after=stop_after)


def trained_head(tmp_path_factory) -> dict:
    """{"head": the HeadFile, "history": the training's (step, losses, top-1) rows}."""
    if "result" in _HELD:
        return _HELD["result"]
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # one per run, shared by its workers
    folder = tmp_path_factory.getbasetemp()
    folder = folder.parent / f"eagle-head-{run}" if run else folder / "eagle-head"
    folder.mkdir(parents=True, exist_ok=True)
    done = folder / "history.json"
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            history = train(folder / "train")["history"]
            done.with_suffix(".tmp").write_text(json.dumps(np.asarray(history).tolist()))
            done.with_suffix(".tmp").replace(done)
    head = load_head(folder / "train" / "head", CONFIG, init_params(CONFIG, seed=1))
    _HELD["result"] = {"head": head, "history": json.loads(done.read_text())}
    return _HELD["result"]
