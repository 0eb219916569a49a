"""llama.cpp as a peer: its own environment, a float32 GGUF of the same weights, and a timed
greedy run in a child process (`scripts/bench peer --model NAME --with llama.cpp`).

llama.cpp is not a kvjax dependency: `environment` builds `llama-cpp-python` (which compiles
llama.cpp, about 6 minutes on two cores) into a virtual environment of its own, once. The
weights are the model's GGUF file with every tensor dequantized to float32 by `gguf`
(`f32_gguf`): the very tensors kvjax's `load_gguf` computes with, in llama.cpp's own layout
and metadata. The child (`llamacpp_child.py`, standard library and `llama_cpp` only) prints
its timings and tokens as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import numpy as np

PACKAGE = "llama-cpp-python==0.3.36"
CHILD = Path(__file__).with_name("llamacpp_child.py")


def environment(folder: Path, echo=print) -> Path:
    """The python of a virtual environment with llama-cpp-python (built on first use)."""
    python = folder / "bin" / "python"
    probe = [str(python), "-c", "import llama_cpp"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    echo(f"building {PACKAGE} into {folder} (compiles llama.cpp: minutes)")
    venv.EnvBuilder(with_pip=True, clear=True).create(folder)
    subprocess.run([str(python), "-m", "pip", "install", "-q", PACKAGE], check=True)
    return python


def f32_gguf(src: Path, dst: Path) -> Path:
    """`src` with every tensor dequantized to float32 (metadata copied as it is)."""
    import gguf
    from gguf.quants import dequantize

    if dst.exists() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(dequantize(t.data, t.tensor_type), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def run(python: Path, model: Path, prompts: list[list[int]], new_tokens: int, reps: int,
        threads: int, prefix: dict | None = None, logits: Path | None = None) -> list[dict]:
    """Per prompt: prefill seconds (time to the first token), total seconds for
    `new_tokens` greedy tokens (medians of `reps` after a warm-up) and the tokens. With
    `prefix` ({"shared": ids, "suffixes": [ids, ...]}), the first row also has the median
    seconds of a one-token request of the shared prefix and a suffix, cold and warm. With
    `logits` (a .npy path), llama.cpp's logits of the first prompt's greedy steps are saved
    there, [new_tokens, vocab]."""
    args = {"model": str(model), "prompts": prompts, "new_tokens": new_tokens, "reps": reps,
            "threads": threads, "prefix": prefix, "logits": str(logits) if logits else None}
    # llama.cpp's OpenMP threads as it runs on its own: the peer benchmark sets passive
    # waiting for PyTorch, which made llama.cpp decode at 20.5 instead of 44.8 tok/s
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([str(python), str(CHILD), json.dumps(args)], capture_output=True,
                         text=True, check=False, env=env)
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-3000:])
        raise RuntimeError(f"the llama.cpp run failed ({out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])
