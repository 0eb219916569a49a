"""Checkpoints and tokenizers: Hugging Face import, orbax save/load, text to token ids."""

from kvjax.io.checkpoint import load, read_metadata, save
from kvjax.io.hf import CheckpointError, config_from_hf, load_hf

__all__ = ["CheckpointError", "config_from_hf", "load", "load_hf", "read_metadata", "save"]
