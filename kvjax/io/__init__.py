"""Checkpoints and tokenizers: Hugging Face import, orbax save/load, text to token ids."""

from kvjax.io.checkpoint import load, read_metadata, save
from kvjax.io.gguf import load_gguf
from kvjax.io.hf import CheckpointError, config_from_hf, eos_ids, hf_config, load_hf, save_hf

__all__ = ["CheckpointError", "config_from_hf", "eos_ids", "hf_config", "load", "load_gguf",
           "load_hf", "read_metadata", "save", "save_hf"]
