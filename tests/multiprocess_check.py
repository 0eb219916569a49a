"""One process of a two-process sharded generate (run by test_sharding.py).

`python multiprocess_check.py PORT PROCESS_ID OUT.json`: joins the coordinator on
127.0.0.1:PORT with 4 CPU devices of its own, serves `requests()` on a data=2,model=4 mesh
spanning both processes, and writes the tokens and logits it read back.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
from helpers import sharp_params

from kvjax import CacheConfig, EngineConfig, Request, sharding
from kvjax.config import ModelConfig

CONFIG = ModelConfig(vocab_size=64, num_layers=1, d_model=64, num_heads=8, num_kv_heads=4,
                     d_ff=128, max_seq_len=256)
ENGINE = EngineConfig(cache=CacheConfig(page_size=8, num_pages=64, prefill_chunk=32,
                                        attn_block=16), max_slots=4, decode_steps=8)


def requests() -> list[Request]:
    rng = np.random.default_rng(2)
    return [Request([int(t) for t in rng.integers(1, 64, 20 + 9 * i)], max_new_tokens=8,
                    return_logits=True) for i in range(4)]


def main(port: int, process_id: int, out: str) -> None:
    sharding.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                        cpu_devices=4)
    import jax

    import kvjax

    engine = kvjax.Engine(sharp_params(CONFIG, seed=5), CONFIG,
                          dataclasses.replace(ENGINE, mesh="data=2,model=4"))
    results = engine.generate(requests())
    with open(out, "w") as f:
        json.dump({"process_count": jax.process_count(), "devices": jax.device_count(),
                   "local_devices": jax.local_device_count(),
                   "tokens": [r.tokens for r in results],
                   "logits": [np.asarray(r.logits).tolist() for r in results]}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
