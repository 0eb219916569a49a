"""Training (optax, orbax checkpoints) on the standard library's Python sources: the loop
in `loop.py`, the corpus and batches in `data.py`."""

from kvjax.train.loop import (
    is_trained,
    loss_fn,
    make_optimizer,
    train,
    train_step,
    trained,
)

__all__ = ["is_trained", "loss_fn", "make_optimizer", "train", "train_step", "trained"]
