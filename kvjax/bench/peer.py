"""Peer benchmark: kvjax vs Hugging Face `transformers` generate, same weights, one run.

A random Llama of the bench shape is built with transformers, saved as safetensors and
loaded by kvjax (`load_hf`), so both run the very same float32 weights on the same CPU.
For batch 1 and 8: prefill time of a 512-token prompt, decode tokens/s for 128 new tokens,
end-to-end time, and whether the greedy tokens agree. Medians after a warm-up. kvjax runs
`generate` under the config's `engine.numerics` (default invariant, with the forms the
engine would choose: the prompts of a batch share prefill calls); `--set
engine.numerics=fast` for one prompt per call. `--model NAME` runs a real checkpoint of
`kvjax.models` instead: kvjax loads its file with `load_gguf`, transformers with its own GGUF
loader (both dequantize to the same float32 tensors); `--with llama.cpp` adds llama.cpp at
batch 1 on a float32 GGUF of those tensors (`kvjax.bench.llamacpp`), and a second table:
`kvjax.generate`, the Engine and llama.cpp, with warm shared-prefix and cold requests (the
Engine and llama.cpp), weight bandwidth and the Engine's aggregate over 8 concurrent
requests (`kvjax.bench.peer_engine`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from pathlib import Path

import jax
import numpy as np

from kvjax.bench import peer_engine
from kvjax.config import CacheConfig
from kvjax.config_files import load_config
from kvjax.decode.batching import pages_for
from kvjax.decode.generate import KVPool, generate
from kvjax.engine.engine import numerics_plans
from kvjax.io.hf import hf_config, load_hf
from kvjax.lab.report import emit, markdown_table, write_results
from kvjax.lab.timing import median_timed
from kvjax.model.layout import store


def _hf_model(model_cfg, folder: Path, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    # The bench shape as an untied Llama, through the same mapping `save_hf` writes.
    fields = hf_config(dataclasses.replace(model_cfg, tie_embeddings=False))
    fields = {k: v for k, v in fields.items() if k not in ("model_type", "architectures")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    model.save_pretrained(folder)
    return model


def _real_model(name: str):
    """(transformers model, config, params) of a `kvjax.models` checkpoint, each side with
    its own loader."""
    import torch
    import transformers

    from kvjax import models

    file = models.path(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    loaded = models.load(name)
    return hf, loaded.config, loaded.params


def main(args) -> int:
    # PyTorch's OpenMP workers spin after each op by default and would steal the cores from
    # the kvjax runs that follow in this process; passive waiting keeps the comparison fair.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.set)
    rng = np.random.default_rng(0)
    if args.model:
        hf, config, params = _real_model(args.model)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            hf = _hf_model(cfg.model, Path(tmp), seed=0)
            config, params = load_hf(tmp)
    cache = CacheConfig(page_size=16, num_pages=1, prefill_chunk=256, attn_block=256)
    # the engine's numerics (default invariant: the prompts share prefill calls), its forms,
    # for each --cpu-kernel setting
    settings = [k.strip() for k in (args.cpu_kernel or cfg.engine.cpu_kernel).split(",")
                if k.strip()]
    loaded_config, loaded_params = config, params  # the Engine chooses its own forms
    runs = {}  # setting -> (its plan, the parameters stored for it)
    for setting in settings:
        kernel, _, form = setting.partition(":")  # "auto:unrolled": without the layer loop
        ec = dataclasses.replace(cfg.engine, cache=cache, cpu_kernel=kernel,
                                 layer_loop=form != "unrolled")
        plan, problems = numerics_plans([config], ec, 0)
        runs[setting] = plan, jax.device_put(store(params, plan))
    emit(f"bench peer: {args.model or 'random bench model'}, {config.num_layers} layers, "
         f"d_model {config.d_model}, "
          f"{config.num_heads}/{config.num_kv_heads} heads, vocab {config.vocab_size}, float32, "
          f"numerics {plan.mode}{' ' + str(problems) if problems else ''}; cpu_kernel "
          f"{', '.join(settings)}; torch {torch.__version__} ({args.threads} threads), "
          f"jax {jax.__version__}")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = rng.integers(0, config.vocab_size, size=(batch, args.prompt_len))
        pages = batch * pages_for(args.prompt_len + args.gen_tokens, 16)
        pool = KVPool(config, dataclasses.replace(cache, num_pages=pages))
        lists = [list(map(int, p)) for p in prompts]

        def kv_run(n, setting, lists=lists, pool=pool):
            plan, stored = runs[setting]
            return generate(stored, config, lists, n, cache=pool, plan=plan)

        def hf_run(n, prompts=prompts):
            with torch.no_grad():
                return hf.generate(torch.tensor(prompts), max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, pad_token_id=0)

        for fn in [functools.partial(kv_run, setting=k) for k in settings] + [hf_run]:
            fn(2)  # warm-up (compilation for kvjax)
            fn(args.gen_tokens)
        hf_prefill, _ = median_timed(lambda: hf_run(1), args.reps)
        hf_total, hf_out = median_timed(lambda: hf_run(args.gen_tokens), args.reps)
        hf_tokens = hf_out[:, args.prompt_len:].numpy()
        decode_n = batch * (args.gen_tokens - 1)
        extra = {}
        if args.with_peer and batch == 1:
            prefix = peer_engine.prefix_workload(config.vocab_size)
            extra = _llamacpp(args, lists, hf_tokens, prefix, loaded_params, loaded_config)
        for setting in settings:
            kv_prefill, _ = median_timed(lambda k=setting: kv_run(1, k), args.reps)
            kv_total, kv_out = median_timed(lambda k=setting: kv_run(args.gen_tokens, k),
                                            args.reps)
            kv_tokens = np.array(kv_out.tokens)
            same = (kv_tokens == hf_tokens).all(axis=1)
            first_diff = [int(np.argmax(a != b)) if not s else None
                          for a, b, s in zip(kv_tokens, hf_tokens, same, strict=True)]
            row = {
                "batch": batch, "cpu_kernel": setting, "prompt_len": args.prompt_len,
                "new_tokens": args.gen_tokens,
                "kvjax_prefill_s": kv_prefill, "hf_prefill_s": hf_prefill,
                "kvjax_decode_tok_s": decode_n / max(kv_total - kv_prefill, 1e-9),
                "hf_decode_tok_s": decode_n / max(hf_total - hf_prefill, 1e-9),
                "kvjax_total_s": kv_total, "hf_total_s": hf_total,
                "speedup_end_to_end": hf_total / kv_total,
                "identical_sequences": int(same.sum()), "first_divergence": first_diff,
            } | extra
            if extra:
                row |= peer_engine.engine_figures(loaded_params, loaded_config,
                                                  args.prompt_len, args.gen_tokens,
                                                  args.reps, prefix, setting)
                gigabytes = peer_engine.weight_bytes(loaded_params) / 1e9
                emit("\n" + peer_engine.table(row, gigabytes))
            rows.append(row)
            emit(f"batch {batch}, cpu_kernel {setting}: kvjax {kv_total:.2f} s, transformers "
                 f"{hf_total:.2f} s ({row['speedup_end_to_end']:.2f}x); identical greedy "
                 f"sequences {row['identical_sequences']}/{batch}"
                 + (f"; llama.cpp {row['llamacpp_total_s']:.2f} s" if "llamacpp_total_s" in row
                    else ""))
    write_results(args.out, markdown_table(rows, COLUMNS), rows, config=args.config,
                  torch=torch.__version__, threads=args.threads, numerics=plan.mode,
                  cpu_kernel=settings)
    return 0


def _llamacpp(args, prompts: list[list[int]], hf_tokens: np.ndarray, prefix: dict, params,
              config) -> dict:
    """llama.cpp's figures for the batch-1 prompt and the shared-prefix workload
    (`peer_engine.prefix_workload`), on the model's weights in float32; and the largest
    |kvjax - llama.cpp| over the logits of its greedy steps (`kvjax.forward` on the prompt
    and those tokens, fast numerics)."""
    from kvjax import models
    from kvjax.bench import llamacpp
    from kvjax.model.transformer import forward

    if not args.model:
        raise SystemExit("--with llama.cpp needs --model (a GGUF checkpoint)")
    python = llamacpp.environment(Path(".venv-llamacpp"), echo=emit)
    src = models.path(args.model)
    f32 = llamacpp.f32_gguf(src, Path.home() / ".cache" / "kvjax" / f"{src.stem}.f32.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "logits.npy"
        (got,) = llamacpp.run(python, f32, prompts, args.gen_tokens, args.reps, args.threads,
                              prefix, logits=saved)
        theirs = np.load(saved)
    ids = np.asarray([prompts[0] + got["tokens"][:-1]])
    ours = np.asarray(forward(params, config, ids))[0, len(prompts[0]) - 1:]
    decode_n = args.gen_tokens - 1
    return {"llamacpp_prefill_s": got["prefill_s"], "llamacpp_total_s": got["total_s"],
            "llamacpp_warm_s": got["warm_s"], "llamacpp_cold_s": got["cold_s"],
            "llamacpp_decode_tok_s": decode_n / max(got["total_s"] - got["prefill_s"], 1e-9),
            "llamacpp_identical": got["tokens"] == hf_tokens[0].tolist(),
            "llamacpp_max_logit_diff": float(np.abs(ours - theirs).max())}


def _llamacpp_cell(key: str, fmt: str):
    return lambda r: format(r[key], fmt) if key in r else "-"


COLUMNS = [
    ("batch", lambda r: str(r["batch"])),
    ("cpu_kernel", lambda r: r.get("cpu_kernel", "off")),
    ("prefill s kvjax / transformers",
     lambda r: f"{r['kvjax_prefill_s']:.2f} / {r['hf_prefill_s']:.2f}"),
    ("decode tok/s kvjax / transformers",
     lambda r: f"{r['kvjax_decode_tok_s']:.1f} / {r['hf_decode_tok_s']:.1f}"),
    ("end-to-end s kvjax / transformers",
     lambda r: f"{r['kvjax_total_s']:.2f} / {r['hf_total_s']:.2f}"),
    ("kvjax speedup", lambda r: f"{r['speedup_end_to_end']:.2f}x"),
    ("identical greedy", lambda r: f"{r['identical_sequences']}/{r['batch']}"),
    ("llama.cpp prefill s", _llamacpp_cell("llamacpp_prefill_s", ".2f")),
    ("llama.cpp decode tok/s", _llamacpp_cell("llamacpp_decode_tok_s", ".1f")),
    ("llama.cpp end-to-end s", _llamacpp_cell("llamacpp_total_s", ".2f")),
    ("llama.cpp = transformers", _llamacpp_cell("llamacpp_identical", "")),
    ("max logit diff kvjax / llama.cpp", _llamacpp_cell("llamacpp_max_logit_diff", ".2e")),
]
