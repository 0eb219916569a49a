"""Training an EAGLE-style head (`kvjax.speculative.eagle`) on a target's features.

Given token windows of recorded text (int32[N, T + 1], a mask of where the loss counts),
the target runs over each window once (`forward(..., features=True)`, the fast plan) and
its features are kept (float16, in `out/data.npz`, reused by a resumed run of the same
windows and target). The head then learns them teacher-forced with EAGLE's loss and
noise, AdamW (`kvjax.train.make_optimizer`), orbax checkpoints of the head and optimizer
state, resume, and a time limit; the target's weights never change. Batches are a pure
function of (seed, step), so a resumed run reaches the weights an uninterrupted one would.
The result is the head's file (`kvjax.speculative.eagle_file`) in `out/head`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.cache.identity import model_fingerprint
from kvjax.config import ModelConfig, TrainConfig
from kvjax.lab.progress import Progress
from kvjax.model.transformer import forward
from kvjax.speculative.eagle import LOSS_WEIGHTS, head_loss, init_head
from kvjax.speculative.eagle_file import HeadFile, save_head
from kvjax.train.loop import check_schedule, make_optimizer, schedule_of
from kvjax.train.npz_cache import load_or_make

NOISE = 0.1  # EAGLE's uniform feature noise, U(-NOISE, NOISE)


def draft_vocab(tokens: np.ndarray, mask: np.ndarray, size: int, vocab_size: int,
                keep=()) -> np.ndarray:
    """int32[size] ascending: the ids most frequent where `mask` holds (then anywhere in
    `tokens`, then the lowest ids), with every id in `keep` (stop tokens)."""
    size = min(size, vocab_size)
    score = (np.bincount(tokens[mask], minlength=vocab_size) * (tokens.size + 1)
             + np.bincount(tokens.ravel(), minlength=vocab_size)).astype(np.float64)
    score[list(keep)] = np.inf
    return np.sort(np.argsort(-score, kind="stable")[:size]).astype(np.int32)


def extract_features(target_params, config: ModelConfig, tokens: np.ndarray,
                     batch_size: int = 8, progress: bool = True) -> np.ndarray:
    """float16[N, T + 1, D]: the target's features over each window of `tokens`."""
    out = np.zeros((*tokens.shape, config.d_model), np.float16)
    bar = Progress(len(tokens), "features") if progress else None
    for start in range(0, len(tokens), batch_size):
        rows = tokens[start:start + batch_size]
        padded = np.zeros((batch_size, tokens.shape[1]), np.int32)  # one compiled shape
        padded[:len(rows)] = rows
        feats = forward(target_params, config, padded, features=True)
        out[start:start + len(rows)] = np.asarray(feats[:len(rows)], np.float16)
        if bar:
            bar.update(len(rows))
    if bar:
        bar.__exit__()
    return out


@partial(jax.jit, static_argnames=("config", "optimizer", "weights"),
         donate_argnames=("head", "state"))
def train_step(head, state, target_params, config: ModelConfig, optimizer, features, tokens,
               mask, vocab, key, noise: float,
               weights: tuple[float, float] = LOSS_WEIGHTS):
    """One AdamW step of the head on a batch (`weights`: `head_loss`'s); donates `head` and
    `state`."""
    features = features.astype(jnp.float32)
    eps = jax.random.uniform(key, features[:, :-1].shape, minval=-noise, maxval=noise)
    (loss, parts), grads = jax.value_and_grad(head_loss, has_aux=True)(
        head, target_params, config, features, tokens, mask, vocab, eps, weights)
    updates, state = optimizer.update(grads, state, head)
    return optax.apply_updates(head, updates), state, loss, parts


@partial(jax.jit, static_argnames=("config", "weights"))
def _eval(head, target_params, config, features, tokens, mask, vocab, weights):
    return head_loss(head, target_params, config, features.astype(jnp.float32), tokens, mask,
                     vocab, weights=weights)


def evaluate(head, target_params, config: ModelConfig, data: dict, vocab,
             batch_size: int, weights: tuple[float, float] = LOSS_WEIGHTS
             ) -> dict:
    """Mean loss (under `weights`), feature and token terms and top-1 agreement over
    `data`'s windows."""
    sums, weight = {}, 0.0
    for start in range(0, len(data["tokens"]), batch_size):
        part = {k: v[start:start + batch_size] for k, v in data.items()}
        loss, parts = _eval(head, target_params, config, part["features"], part["tokens"],
                            part["mask"], vocab, weights)
        w = float(part["mask"][:, 1:].sum())
        for name, value in {"loss": loss, **parts}.items():
            sums[name] = sums.get(name, 0.0) + float(value) * w
        weight += w
    return {k: v / max(weight, 1.0) for k, v in sums.items()}


def _windows_digest(tokens: np.ndarray, mask: np.ndarray, target: str) -> str:
    return hashlib.sha256(tokens.tobytes() + mask.tobytes() + target.encode()).hexdigest()


def _data(out: Path, target_params, config, tokens, mask, target: str, log,
          progress: bool) -> np.ndarray:
    """The windows' features, from `out/data.npz` when it holds these windows' and target's."""
    file = out / "data.npz"
    arrays, loaded = load_or_make(file, _windows_digest(tokens, mask, target), lambda: {
        "features": extract_features(target_params, config, tokens, progress=progress)})
    if loaded:
        log(f"features of {len(tokens)} windows from {file}")
    return arrays["features"]


def _save_state(out: Path, head, state, step: int, history: list, windows: str,
                schedule: dict) -> None:
    """`out/ckpt`: the head, the optimizer state, the step, the digest of the windows it
    learns (`_windows_digest`) and its schedule (`schedule_of`), written atomically."""
    import orbax.checkpoint as ocp

    tmp, final = out / "ckpt.tmp", out / "ckpt"
    shutil.rmtree(tmp, ignore_errors=True)
    saver = ocp.StandardCheckpointer()
    saver.save(tmp.absolute(), {"head": head, "state": state,
                                "step": np.asarray(step, np.int64)}, force=True)
    saver.wait_until_finished()
    (tmp / "history.npy").write_bytes(np.asarray(history, np.float64).tobytes())
    (tmp / "windows.txt").write_text(windows)
    (tmp / "schedule.json").write_text(json.dumps(schedule))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def _restore_state(out: Path, head, state):
    import orbax.checkpoint as ocp

    shapes = jax.eval_shape(lambda: {"head": head, "state": state,
                                     "step": np.asarray(0, np.int64)})
    tree = ocp.StandardCheckpointer().restore((out / "ckpt").absolute(), shapes)
    history = np.frombuffer((out / "ckpt" / "history.npy").read_bytes(), np.float64)
    return tree["head"], tree["state"], int(tree["step"]), history.reshape(-1, 4).tolist()


def train_head(target_params, config: ModelConfig, windows: tuple[np.ndarray, np.ndarray],
               validation: tuple[np.ndarray, np.ndarray], train: TrainConfig,
               vocab_size: int, out_dir, keep=(), resume: bool = True, log=print,
               progress: bool = True, metadata: dict | None = None,
               stop_after: int | None = None,
               weights: tuple[float, float] = LOSS_WEIGHTS) -> dict:
    """Trains a head on `windows` (tokens int32[N, T + 1], mask bool[N, T + 1]) with
    `train`'s schedule (steps, batch size, learning rate, seed, time limit; seq_len is the
    windows') and `head_loss`'s (feature, token) `weights`, validating on `validation`; the
    draft vocabulary is the `vocab_size` ids most frequent under the mask, with `keep`.
    `stop_after` stops after that many steps with a checkpoint (as an interruption would).
    Returns the metrics and the head's file."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = model_fingerprint(config, target_params)
    t_data = time.perf_counter()
    data = {"tokens": windows[0], "mask": windows[1],
            "features": _data(out, target_params, config, *windows, target, log, progress)}
    held = {"tokens": validation[0], "mask": validation[1],
            "features": _data(out / "validation", target_params, config, *validation,
                              target, log, progress)}
    data_s = time.perf_counter() - t_data
    vocab = draft_vocab(windows[0], windows[1], vocab_size, config.vocab_size, keep)
    optimizer = make_optimizer(train)
    head = init_head(config, train.seed)
    state, step, history = optimizer.init(head), 0, []
    weights = tuple(float(w) for w in weights)
    # what a checkpoint was trained for: its windows, target and loss (weights (1, 0.1), the
    # default, keep the digest that checkpoints written before the weights were a knob hold)
    windows_digest, schedule = _windows_digest(*windows, target), schedule_of(train)
    if weights != LOSS_WEIGHTS:
        windows_digest += f" loss weights {weights}"
    if resume and (out / "ckpt").exists():
        saved = out / "ckpt" / "windows.txt"
        if not saved.is_file() or saved.read_text() != windows_digest:
            raise ValueError(f"{out}/ckpt was trained on other windows, another target or "
                             f"other loss weights: resuming would mix two trainings; start "
                             f"over (resume=False, train_eagle --no-resume) or train into "
                             f"another folder")
        recorded = out / "ckpt" / "schedule.json"
        check_schedule(json.loads(recorded.read_text()) if recorded.is_file() else None,
                       train, f"{out}/ckpt")
        head, state, step, history = _restore_state(out, head, state)
        log(f"resumed {out}/ckpt at step {step}")
    else:  # the untrained head's figures: where the loss falls from
        val = evaluate(head, target_params, config, held, vocab, train.batch_size, weights)
        history.append([0, float("nan"), val["loss"], val["top1"]])
    bar = Progress(train.steps, "eagle", start=step) if progress else None
    trained_s, loss = 0.0, float("nan")
    end = train.steps if stop_after is None else min(train.steps, step + stop_after)
    while step < end:
        rng = np.random.default_rng([train.seed, step])
        rows = rng.integers(0, len(data["tokens"]), train.batch_size)
        key = jax.random.fold_in(jax.random.PRNGKey(train.seed), step)
        t0 = time.perf_counter()
        head, state, loss_arr, parts = train_step(
            head, state, target_params, config, optimizer, data["features"][rows],
            data["tokens"][rows], data["mask"][rows], vocab, key, NOISE, weights)
        loss = float(loss_arr)
        trained_s += time.perf_counter() - t0
        step += 1
        if bar:
            bar.update(1, loss=loss, top1=float(parts["top1"]))
        if step % train.eval_every == 0 or step == train.steps:
            val = evaluate(head, target_params, config, held, vocab, train.batch_size,
                           weights)
            history.append([step, loss, val["loss"], val["top1"]])
            log(f"\nstep {step}: train loss {loss:.4f}, validation loss {val['loss']:.4f}, "
                f"top-1 {val['top1']:.3f}")
        timed_out = train.time_limit_s is not None and trained_s >= train.time_limit_s
        if step % train.checkpoint_every == 0 or step == end or timed_out:
            _save_state(out, head, state, step, history, windows_digest, schedule)
        if timed_out:
            log(f"time limit {train.time_limit_s} s reached at step {step}")
            break
    if bar:
        bar.__exit__()
    val = evaluate(head, target_params, config, held, vocab, train.batch_size, weights)
    file: HeadFile = save_head(out / "head", head, vocab, config, target_params, {
        **(metadata or {}), "step": step, "validation": val, "windows": len(windows[0]),
        "loss_weights": {"feature": weights[0], "token": weights[1]},
        "seq_len": int(windows[0].shape[1] - 1)})
    return {"step": step, "train_loss": loss, "validation": val, "history": history,
            "train_seconds": trained_s, "data_seconds": data_s, "head": file,
            "out": str(out / "head")}
