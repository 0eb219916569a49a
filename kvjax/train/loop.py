"""Training small models (targets and drafts) with optax on the stdlib corpus.

AdamW with linear warmup and cosine decay, next-token cross-entropy, periodic validation,
orbax checkpoints (model + optimizer state + step) written atomically, and resume: a run
restarted after an interruption continues from its last checkpoint and, because batches
are a pure function of (seed, step), reaches exactly the weights an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.config import Config, ModelConfig, TrainConfig
from kvjax.io import checkpoint
from kvjax.io.hf import CheckpointError
from kvjax.lab.progress import Progress
from kvjax.memory.calculator import num_params
from kvjax.model.transformer import Transformer, init_params
from kvjax.train import data


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=train.learning_rate, warmup_steps=train.warmup_steps,
        decay_steps=train.steps, end_value=train.learning_rate * train.min_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(train.grad_clip),
                       optax.adamw(schedule, weight_decay=train.weight_decay))


# TrainConfig's fields that do not change the weights a run reaches: how often it reports
# and saves, where, and for how long one invocation trains
_NOT_SCHEDULE = ("eval_every", "eval_batches", "checkpoint_every", "out_dir", "time_limit_s")


def schedule_of(train: TrainConfig) -> dict:
    """The part of `train` a resumed run must share with its checkpoint: with another
    length, rate or seed it would splice two schedules (the cosine's step count is in the
    optimizer state, its length is not) and reach weights no single run reaches."""
    return {k: v for k, v in dataclasses.asdict(train).items() if k not in _NOT_SCHEDULE}


def check_schedule(saved: dict | None, train: TrainConfig, where) -> None:
    """Raises CheckpointError when the checkpoint at `where` was trained with another
    schedule than `train`'s (`saved`: its TrainConfig as a dict, whole or `schedule_of`'s
    part); None, a checkpoint from before schedules were recorded, passes."""
    if saved is None:
        return
    # a field added to TrainConfig after the checkpoint was written reads as its default
    fields = TrainConfig.__dataclass_fields__
    diff = [f"{k} {saved.get(k, fields[k].default)} -> {v}"
            for k, v in schedule_of(train).items() if saved.get(k, fields[k].default) != v]
    if diff:
        raise CheckpointError(f"{where} was trained with another schedule ({', '.join(diff)}): "
                              f"resuming would splice two schedules; start over (--no-resume "
                              f"/ resume=False, or delete the folder) or train into another "
                              f"folder")


def loss_fn(params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats per token) of int32[B, T + 1] windows."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    logits, _ = Transformer(config).apply({"params": params}, inputs, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@partial(jax.jit, static_argnames=("config", "optimizer"), donate_argnames=("params", "opt_state"))
def train_step(params, opt_state, tokens, config: ModelConfig, optimizer):
    """One AdamW step. Donates `params` and `opt_state`."""
    loss, grads = jax.value_and_grad(loss_fn)(params, config, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


eval_loss = jax.jit(loss_fn, static_argnames=("config",))


def _validation_loss(params, config: ModelConfig, train: TrainConfig, ids) -> float:
    losses = [float(eval_loss(params, config, data.batch(ids, train.batch_size, train.seq_len,
                                                         seed=10**6 + train.seed, step=i)))
              for i in range(train.eval_batches)]
    return float(np.mean(losses))


def _save(out: Path, config: ModelConfig, params, opt_state, meta: dict) -> None:
    """Writes `out/ckpt` atomically (a crash mid-write leaves the previous one)."""
    import orbax.checkpoint as ocp

    tmp, final, old = out / "ckpt.tmp", out / "ckpt", out / "ckpt.old"
    shutil.rmtree(tmp, ignore_errors=True)
    checkpoint.save(tmp / "model", config, params, metadata=meta)
    saver = ocp.StandardCheckpointer()
    saver.save((tmp / "opt").absolute(), opt_state, force=True)
    saver.wait_until_finished()
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _restore(out: Path, config: ModelConfig, optimizer, params_shape):
    import orbax.checkpoint as ocp

    saved_config, params = checkpoint.load(out / "ckpt" / "model")
    if saved_config != config:
        raise CheckpointError(f"{out}/ckpt was trained with another model config; use a new "
                              f"out_dir or delete it")
    target = jax.eval_shape(optimizer.init, params_shape)
    opt_state = ocp.StandardCheckpointer().restore((out / "ckpt" / "opt").absolute(), target)
    meta = checkpoint.read_metadata(out / "ckpt" / "model")["metadata"]
    return params, opt_state, meta


def train(config: Config, out_dir: str | None = None, resume: bool = True,
          stop_after: int | None = None, log=print, progress: bool = True) -> dict:
    """Trains `config.model` with `config.train`; returns the final metrics.

    `stop_after` stops early after that many steps (as an interruption would), with a
    checkpoint. The final weights are in `out_dir/ckpt/model` (`kvjax.io.load`).
    """
    model, tc = config.model, config.train
    out = Path(out_dir or tc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = data.load_corpus(tc.validation_fraction, tc.max_files)
    optimizer = make_optimizer(tc)
    params = init_params(model, tc.seed)
    step, history = 0, []
    if resume and (out / "ckpt").exists():
        params, opt_state, meta = _restore(out, model, optimizer, params)
        check_schedule(meta.get("train"), tc, f"{out}/ckpt")
        step, history = meta["step"], meta.get("history", [])
        log(f"resumed {out}/ckpt at step {step}")
    else:
        opt_state = optimizer.init(params)
    log(f"train: {model.num_layers} layers, d_model {model.d_model}, "
        f"{num_params(model):,} params; corpus "
        f"{len(corpus['train']):,} train / {len(corpus['validation']):,} validation tokens; "
        f"{tc.steps} steps of {tc.batch_size} x {tc.seq_len} tokens")
    end = tc.steps if stop_after is None else min(tc.steps, step + stop_after)
    first_step, t_start, trained_s, loss = step, time.perf_counter(), 0.0, float("nan")
    bar = Progress(tc.steps, "train", start=step) if progress else None
    while step < end:
        tokens = data.batch(corpus["train"], tc.batch_size, tc.seq_len, tc.seed, step)
        t0 = time.perf_counter()
        params, opt_state, loss_arr = train_step(params, opt_state, tokens, model, optimizer)
        loss = float(loss_arr)
        trained_s += time.perf_counter() - t0
        step += 1
        tokens_per_s = tc.batch_size * tc.seq_len * (step - first_step) / max(
            time.perf_counter() - t_start, 1e-9)
        if bar:
            bar.update(1, loss=loss, tok_s=int(tokens_per_s))
        record = None
        if step % tc.eval_every == 0 or step == end:
            record = {"step": step, "train_loss": loss,
                      "val_loss": _validation_loss(params, model, tc, corpus["validation"])}
            history.append(record)
            log(f"\nstep {step}: train loss {loss:.4f}, validation loss {record['val_loss']:.4f}")
        timed_out = tc.time_limit_s is not None and trained_s >= tc.time_limit_s
        if step % tc.checkpoint_every == 0 or step == end or timed_out:
            _save(out, model, params, opt_state,
                  {"step": step, "history": history, "train": dataclasses.asdict(tc)})
        if timed_out:
            log(f"time limit {tc.time_limit_s} s reached at step {step}")
            break
    if bar:
        bar.__exit__()
    final = history[-1] if history else {"step": step, "train_loss": loss}
    return {**final, "out": str(out / "ckpt" / "model"), "train_seconds": trained_s,
            "history": history}


def is_trained(config_path: str, out_dir: str, overrides=()) -> bool:
    """Whether `out_dir` holds the finished model `config_path` (+ overrides) trains.

    A checkpoint of another model config there is a CheckpointError, never a silent swap.
    """
    from kvjax.config_files import load_config

    return _finished(load_config(config_path, overrides), out_dir, config_path, overrides)


def _finished(config: Config, out_dir: str, config_path: str, overrides) -> bool:
    path = Path(out_dir) / "ckpt" / "model"
    if not path.exists():
        return False
    meta = checkpoint.read_metadata(path)
    if meta["config"] != json.loads(json.dumps(dataclasses.asdict(config.model))):
        raise CheckpointError(f"{out_dir} holds a model of another config than {config_path}"
                              + (f" with {', '.join(overrides)}" if overrides else "")
                              + "; use another folder or delete it")
    return meta["metadata"].get("step", 0) >= config.train.steps


def trained(config_path: str, out_dir: str, overrides=(), log=print) -> tuple:
    """(params, model config) of the model `config_path` trains into `out_dir`, training
    it first (or finishing an interrupted run) when `out_dir` holds no finished checkpoint.

    `overrides` (`section.key=value`) make a shorter setting, e.g. `train.steps=60`.
    """
    from kvjax.config_files import load_config

    path = Path(out_dir) / "ckpt" / "model"
    config = load_config(config_path, overrides)
    if _finished(config, out_dir, config_path, overrides):
        return checkpoint.load(path)[::-1]
    log(f"training {config_path} into {out_dir} ({config.train.steps} steps"
        + (f"; {', '.join(overrides)}" if overrides else "") + ")")
    train(config, out_dir=out_dir, resume=True, log=log)
    return checkpoint.load(path)[::-1]
