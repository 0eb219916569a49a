"""`kvjax run|generate|train|memory|bench` on the command line."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from kvjax.config import ConfigError, ModelConfig
from kvjax.config_files import load_config
from kvjax.memory.calculator import KV_FORMATS


def _generate(args: argparse.Namespace) -> int:
    from kvjax.decode.generate import generate
    from kvjax.model.transformer import init_params

    config = load_config(args.config, args.set)
    model, gen = config.model, config.generate
    print(f"config: {args.config}  model: {model.num_layers} layers, d_model {model.d_model}, "
          f"{model.num_heads} heads / {model.num_kv_heads} kv heads, vocab {model.vocab_size}")
    print(f"cache: page_size {config.cache.page_size}, {config.cache.num_pages} pages, "
          f"{config.cache.dtype}; sampling: {config.sampling}")
    params = init_params(model, gen.seed)
    prompts = [list(p.encode("utf-8")) for p in gen.prompts]  # byte-level ids
    if max(max(p) for p in prompts) >= model.vocab_size:
        raise ConfigError("model.vocab_size", "byte-level prompts need vocab_size >= 256")
    result = generate(params, model, prompts, gen.max_new_tokens, sampling=config.sampling,
                      cache=config.cache, stop_token=gen.stop_token)
    for text, tokens in zip(gen.prompts, result.tokens, strict=True):
        print(f"\nprompt: {text!r}")
        print(f"tokens: {tokens}")
        print(f"text:   {bytes(t for t in tokens if t < 256).decode('utf-8', 'replace')!r}")
    s = result.stats
    print(f"\nprefill: {s['prompt_tokens']} tokens in {s['prefill_s'] * 1e3:.1f} ms "
          f"(includes compilation on a first run)")
    print(f"decode:  {s['generated_tokens']} tokens in {s['decode_s'] * 1e3:.1f} ms, "
          f"{s['decode_tokens_per_s']:.1f} tokens/s after the first")
    print(f"cache:   {s['pages_used']} of {s['pages_total']} pages used "
          f"({s['kv_bytes_used']:,} of {s['kv_bytes_total']:,} bytes)")
    return 0


def _memory(args: argparse.Namespace) -> int:
    from kvjax import memory
    from kvjax.memory import planner as memory_plan
    from kvjax.memory.calculator import kv_bytes_per_scalar

    device_memory = round((args.device_memory_gib or 80.0) * memory_plan.GIB)
    if args.table is not None:
        if args.kv_format is not None:
            raise ConfigError("kv_format", "the table takes --kv-bytes (one width for every "
                                           "model); --kv-format needs one model's head_dim")
        paths = args.table or memory_plan.LARGE_CONFIGS
        for path in paths:
            if not Path(path).is_file():
                raise ConfigError("table", f"{path}: no such file (the shipped configs are "
                                           f"found from the repository root)")
        configs = {Path(p).stem: load_config(p, args.set).model for p in paths}
        print(memory_plan.scale_table(configs, device_memory=device_memory,
                                 kv_bytes_per_scalar=args.kv_bytes, param_bytes=args.param_bytes,
                                 page_size=args.page_size, reserve=args.reserve))
        return 0
    if args.config:
        model = load_config(args.config, args.set).model
    else:
        model = ModelConfig(num_layers=args.layers, num_kv_heads=args.kv_heads,
                            num_heads=args.heads or args.kv_heads, head_dim=args.head_dim,
                            d_model=args.d_model, d_ff=args.d_ff, vocab_size=args.vocab,
                            max_seq_len=args.max_seq_len, tie_embeddings=args.tied)
    if args.kv_format is not None:  # scales included (calculator.kv_bytes_per_scalar)
        args.kv_bytes = kv_bytes_per_scalar(args.kv_format, model.head_dim, args.page_size)
    plan = None  # made first, so that a bad mesh is refused before anything is printed
    if args.mesh is not None or args.device_memory_gib is not None:
        plan = memory_plan.plan_report(
            model, mesh=args.mesh or "model=1", device_memory=device_memory,
            kv_bytes_per_scalar=args.kv_bytes, param_bytes=args.param_bytes,
            page_size=args.page_size, reserve=args.reserve,
            batch=args.batch, context=args.context)
    print(memory.report(model, batch=args.batch, context=args.context,
                        page_size=args.page_size, kv_bytes_per_scalar=args.kv_bytes,
                        param_bytes=args.param_bytes, prefill_tokens=args.prefill_tokens,
                        peak_flops=args.peak_gflops * 1e9, bandwidth=args.bandwidth_gbs * 1e9))
    if plan is not None:
        print("\n" + plan)
    return 0


def _train(args: argparse.Namespace) -> int:
    from kvjax.train.loop import train

    config = load_config(args.config, args.set)
    result = train(config, out_dir=args.out, resume=not args.no_resume)
    print(f"done: step {result['step']}, train loss {result['train_loss']:.4f}"
          + (f", validation loss {result['val_loss']:.4f}" if "val_loss" in result else "")
          + f" ({result['train_seconds']:.0f} s of training); model in {result['out']}")
    return 0


def _to_clone_root(args: argparse.Namespace, root: Path | None) -> None:
    """From anywhere inside a clone, runs as from its root: the paths a config names
    (configs/..., results/...) are the clone's. Paths given here are taken from where the
    command was typed."""
    cwd = Path.cwd().resolve()
    if root is None or cwd == root or not cwd.is_relative_to(root):
        return
    for key in ("config", "out", "publish"):
        if getattr(args, key, None) is not None:
            setattr(args, key, str(Path(getattr(args, key)).resolve()))
    os.chdir(root)


def _run(args: argparse.Namespace) -> int:
    from kvjax.lab import registry as experiments
    from kvjax.lab import runner
    from kvjax.lab.results import publish

    _to_clone_root(args, experiments.root())
    if args.list:
        configs = runner.shipped_configs(Path("configs"))
        for name in experiments.shipped():
            where = "  ".join(str(c) for c in configs.get(name, []))
            print(f"{name:22s} {experiments.describe(experiments.load(name))}"
                  + (f"\n{'':22s} {where}" if where else ""))
        return 0
    if args.config is None:
        raise ConfigError("config", "give a config file (or --list)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("kvjax run: plots need matplotlib: pip install 'kvjax[experiments]'",
              file=sys.stderr)
        return 2
    exp = runner.resolve(args.config, args.set)
    print(f"{exp.name}: {experiments.describe(exp.module)} ({len(exp.points)} points, "
          f"scale {exp.scale}, seed {exp.seed})")
    out = runner.run(exp, args.out, fresh=args.fresh)
    if args.publish:
        for path in publish(out, Path(args.publish), exp.name):
            print(f"copied {path}")
    print("\n" + (out / "summary.md").read_text())
    print(f"results: {out}/ (summary.md, metrics.jsonl, metrics.csv, plots)")
    return 0


def _bench(args: argparse.Namespace) -> int:
    """Runs `kvjax.bench.<which>.main` (each benchmark is a module of its own)."""
    return importlib.import_module(f"kvjax.bench.{args.which}").main(args)


# Timed repetitions (medians) per benchmark when --reps is not given.
BENCH_REPS = {"decode": 5, "prefix": 1, "peer": 3, "spec": 3, "tiles": 7, "numerics": 3,
              "arrivals": 3, "preemption": 3, "profile": 5, "trie": 1, "kv_format": 3,
              "tiers": 5, "tree": 5, "eagle": 5,
              "kernel": 15, "startup": 1, "context": 5, "gamma": 5}


def fill_bench_defaults(args: argparse.Namespace) -> None:
    """Fills the defaults of `kvjax bench` that depend on which benchmark runs."""
    args.out = args.out or f"results/bench_{args.which}.json"
    args.reps = args.reps or BENCH_REPS[args.which]
    pressure = args.which == "preemption"  # short prompts, long answers: growth preempts
    questions = {"tree": 16, "eagle": 80, "context": 4}.get(args.which, 32)
    for key, default in (("requests", 8 if pressure else questions),
                         ("prompt_len", 64 if pressure else 1024 if args.which == "tiers" else 512),
                         ("gen_tokens", 448 if pressure else 8 if args.which == "startup"
                          else 128)):
        if getattr(args, key) is None:
            setattr(args, key, default)
    args.slots = args.slots or (1 if args.which == "spec" else 8)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment config (a sweep) into a results folder")
    run.add_argument("config", nargs="?", help="a TOML file in configs/ naming an experiment")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="seed=1, scale=small, params.<field>=V (or <field>=V), "
                          "sweep.<field>=[...]")
    run.add_argument("--out", help="results folder (default results/<config name>[-small])")
    run.add_argument("--fresh", action="store_true",
                     help="discard earlier results in the folder instead of resuming")
    run.add_argument("--publish", metavar="DIR",
                     help="also copy the plots to DIR (docs/, where the documentation shows them)")
    run.add_argument("--list", action="store_true", help="list the shipped experiments")
    run.set_defaults(func=_run)

    gen = sub.add_parser("generate", help="generate from a model built from a config")
    gen.add_argument("config", help="a TOML file in configs/")
    gen.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set model.num_layers=4")
    gen.set_defaults(func=_generate)

    tr = sub.add_parser("train", help="train a small model on the stdlib corpus (optax)")
    tr.add_argument("config", help="a TOML file with [model] and [train] tables")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    tr.add_argument("--out", help="output folder (default: train.out_dir)")
    tr.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint")
    tr.set_defaults(func=_train)

    mem = sub.add_parser("memory", help="KV memory calculator and prefill/decode cost explorer")
    mem.add_argument("--config", help="take the model from this TOML file")
    mem.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    mem.add_argument("--layers", type=int, default=32)
    mem.add_argument("--heads", type=int, default=32)
    mem.add_argument("--kv-heads", type=int, default=8)
    mem.add_argument("--head-dim", type=int, default=128)
    mem.add_argument("--d-model", type=int, default=4096)
    mem.add_argument("--d-ff", type=int, default=14336)
    mem.add_argument("--vocab", type=int, default=128256)
    mem.add_argument("--max-seq-len", type=int, default=8192)
    mem.add_argument("--tied", action="store_true", help="tied input/output embeddings")
    mem.add_argument("--batch", type=int, default=1)
    mem.add_argument("--context", type=int, default=4096)
    mem.add_argument("--prefill-tokens", type=int, default=2048)
    mem.add_argument("--page-size", type=int, default=16)
    mem.add_argument("--kv-bytes", type=int, default=2, help="bytes per cached scalar")
    mem.add_argument("--kv-format", choices=tuple(KV_FORMATS), default=None,
                     help="the pages' format: bytes per cached scalar with its scales "
                          "(instead of --kv-bytes)")
    mem.add_argument("--param-bytes", type=int, default=2, help="bytes per weight")
    mem.add_argument("--peak-gflops", type=float, default=989e3,
                     help="machine peak (default: H100 bf16 dense)")
    mem.add_argument("--bandwidth-gbs", type=float, default=3350.0,
                     help="machine memory bandwidth (default: H100 SXM HBM3)")
    plan = mem.add_argument_group("per-device plan (printed when --mesh or "
                                  "--device-memory-gib is given)")
    plan.add_argument("--mesh", help="price this mesh, e.g. data=2,model=4 (axes: data, "
                                     "model; a missing axis is 1); no devices needed")
    plan.add_argument("--device-memory-gib", type=float, default=None,
                      help="memory of each device (default 80)")
    plan.add_argument("--reserve", type=float, default=0.1,
                      help="fraction of device memory held back for activations, logits and "
                           "XLA workspace (an assumption, not measured; default 0.1)")
    plan.add_argument("--table", nargs="*", metavar="CONFIG", default=None,
                      help="print only the markdown scale table (weights and KV per device, "
                           "largest batch at 8k context, largest context at batch 1) for "
                           "these configs (default: configs/models/llama3_8b.toml and "
                           "llama3_70b.toml) at model=1, model=8 and data=2,model=4")
    mem.set_defaults(func=_memory)

    bench = sub.add_parser("bench", help="benchmarks: decode (paged vs dense vs no cache), "
                                         "prefix (prefix cache on vs off), peer (vs "
                                         "transformers generate), spec (speculative "
                                         "decoding operating point), tiles (row-invariant "
                                         "matmul tiles: bits and cost), numerics (fast vs "
                                         "invariant numerics), arrivals (decode latency "
                                         "while a long prompt is prefilled), preemption "
                                         "(resume vs recompute under memory pressure), "
                                         "profile (where a decode token's time goes), "
                                         "trie (host time per admission against cached "
                                         "pages), tiers (a prefix restored from the host "
                                         "or disk tier vs prefilled), kv_format (bfloat16, "
                                         "int8 and float8 pages "
                                         "against float32 on the real model), tree (n-gram "
                                         "chains vs trees on MT-Bench, verify cost per node "
                                         "count), eagle (the EAGLE-style head's chains and "
                                         "trees vs n-gram and plain decoding on MT-Bench), "
                                         "kernel (the row-count-invariant CPU product vs "
                                         "XLA's), startup (a new process's steps to its "
                                         "first answers, cold and warm compilation cache), "
                                         "context (page tables over the whole context vs "
                                         "grown with the sequence), gamma (one "
                                         "speculative program for every γ vs one per γ)")
    bench.add_argument("which", nargs="?",
                       choices=tuple(BENCH_REPS),
                       default="decode")
    bench.add_argument("--config", default="configs/bench.toml")
    bench.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    bench.add_argument("--out", help="JSON output (default results/bench_<which>.json)")
    bench.add_argument("--reps", type=int, default=None,
                       help="timed repetitions, median (default 5 decode, 1 prefix)")
    decode = bench.add_argument_group("decode")
    decode.add_argument("--batches", default="1,8")
    decode.add_argument("--contexts", default="512,2048")
    decode.add_argument("--steps", type=int, default=32, help="decode steps per timed run")
    decode.add_argument("--prompt-lens", default="32,512", help="(context) prompt lengths")
    decode.add_argument("--no-warmup", action="store_true",
                        help="(startup) no Engine.warmup(): programs compile at first use")
    prefix = bench.add_argument_group("prefix")
    prefix.add_argument("--requests", type=int, default=None,
                        help="requests (default 32 prefix and kv_format questions, 8 "
                             "preemption)")
    prefix.add_argument("--system-len", type=int, default=1024)
    prefix.add_argument("--suffix-len", type=int, default=32)
    prefix.add_argument("--conversations", type=int, default=8)
    prefix.add_argument("--turns", type=int, default=6)
    prefix.add_argument("--turn-system-len", type=int, default=256)
    prefix.add_argument("--user-len", type=int, default=32)
    prefix.add_argument("--examples", type=int, default=4)
    prefix.add_argument("--example-len", type=int, default=128)
    prefix.add_argument("--new-tokens", type=int, default=16)
    prefix.add_argument("--slots", type=int, default=None,
                        help="engine batch slots (default 8 prefix, 1 spec)")
    prefix.add_argument("--num-pages", type=int, default=2048)
    prefix.add_argument("--workloads", default="system_prompt,multi_turn,few_shot",
                        help="(prefix) which workloads to run, comma-separated")
    peer = bench.add_argument_group("peer")
    peer.add_argument("--prompt-len", type=int, default=None,
                      help="(peer, spec, preemption) default 512; 64 preemption")
    peer.add_argument("--gen-tokens", type=int, default=None,
                      help="(peer, spec, arrivals, preemption, kv_format) default 128; 448 "
                           "preemption")
    peer.add_argument("--threads", type=int, default=2, help="torch threads")
    peer.add_argument("--model", default=None,
                      help="(peer, profile, kv_format, tiers) a kvjax.models checkpoint instead of "
                           "the random bench model; (startup) default smollm2-135m-instruct, "
                           "'random' for the bench model")
    peer.add_argument("--with", dest="with_peer", choices=("llama.cpp",), default=None,
                      help="(peer, with --model) also llama.cpp at batch 1, built into "
                           ".venv-llamacpp on first use, on a float32 GGUF of the same weights")
    peer.add_argument("--cpu-kernel", default=None,
                      help="(peer, eagle) EngineConfig.cpu_kernel: off, products or auto "
                           "(kvjax's CPU kernel where it runs; default: the config's, auto); "
                           "peer: several side by side, comma-separated, e.g. off,auto; "
                           "auto:unrolled is auto without the layer loop")
    peer.add_argument("--formats", default=None,
                      help="(kv_format) page formats, comma-separated, float32 first "
                           "(default float32,bfloat16,int8,float8_e4m3fn)")
    trie = bench.add_argument_group("trie")
    trie.add_argument("--pages", default="10000,100000,1000000",
                      help="(trie) cached-page counts, comma-separated")
    trie.add_argument("--admissions", type=int, default=200,
                      help="(trie) timed admissions per size, median")
    bench.add_argument("--passes", type=int, default=3,
                       help="(numerics) alternating passes over fast and invariant")
    bench.add_argument("--arrival-len", type=int, default=2048,
                       help="(arrivals) the long prompt's tokens")
    bench.add_argument("--after", type=int, default=16,
                       help="(arrivals) rounds are timed until the newcomer has this many tokens")
    bench.add_argument("--steady", type=int, default=4,
                       help="(arrivals) rounds timed before the arrival")
    bench.add_argument("--fit", type=int, default=4,
                       help="(preemption) requests the cache holds at full length")
    eagle = bench.add_argument_group("eagle")
    eagle.add_argument("--head", default="checkpoints/eagle-full/head",
                       help="(eagle) the head's folder (scripts/train_eagle); '' for none")
    eagle.add_argument("--numerics", choices=("fast", "invariant"), default="fast",
                       help="(eagle) fast: speed; invariant: every answer checked bitwise")
    eagle.add_argument("--methods", default="",
                       help="(eagle) comma-separated methods beside plain decoding (default "
                            "all but the '... 8 on device' ones, which run when named), e.g. "
                            "'n-gram tree,eagle tree 16'")
    spec = bench.add_argument_group("spec")
    spec.add_argument("--target", default="checkpoints/target/ckpt/model")
    spec.add_argument("--draft", default="checkpoints/draft/ckpt/model")
    spec.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    spec.add_argument("--gammas", default="1,2,3,4,6,8", help="(spec, gamma) the γ values")
    spec.add_argument("--adaptive-steps", type=int, default=32,
                      help="tokens per engine call, where adaptive γ is re-chosen")
    spec.add_argument("--plot", default="docs/spec_operating_point.png")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        fill_bench_defaults(args)
    if args.command != "memory":  # every command that compiles (the calculator does not)
        from kvjax.decode import compile_cache

        compile_cache.enable()  # compiled programs kept across runs (kvjax.decode.compile_cache)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"kvjax: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
