"""Start-up benchmark: what a new process pays before its first answer, cold and warm.

Each run is a fresh Python process that does what the README's first example does and
times each step: `import kvjax`, `kvjax.models.load` (or a random model of the bench
config's shape with `--model random`), `Engine(...)`, `Engine.warmup()` (the programs of a
chat, greedy and sampled), the first answer (a chat question, `--gen-tokens` greedy tokens)
and a second answer to a question of another length. Beside
each step: the programs it asked XLA for, and how many of them the persistent compilation
cache (`kvjax.decode.compile_cache`) gave back instead of compiling. "cold" runs with an empty
cache folder, "warm" runs again with the folder the cold run filled; `--reps` pairs of
runs, medians. The kernel and probe caches are kept (they are what a second process has).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from kvjax.lab.report import emit, markdown_table, write_results

STEPS = ("import", "load", "engine", "warm-up", "first answer", "second answer")
QUESTIONS = ("What is the capital of France?",
             "And which river flows through its centre, and how long is that river?")

# The child process: prints one JSON line {step: [seconds, requests, hits]}.
CHILD = """
import json, sys, time
start = time.perf_counter()
import jax
counts = {"/jax/compilation_cache/compile_requests_use_cache": 0,
          "/jax/compilation_cache/cache_hits": 0}
def listen(event, **_):
    if event in counts:
        counts[event] += 1
    if event == "/kvjax/programs/loaded":  # a step's program by kvjax's own key
        for name in counts:
            counts[name] += 1
jax.monitoring.register_event_listener(listen)
out, last = {}, [start, 0, 0]
def mark(step):
    now = time.perf_counter()
    req, hit = counts.values()
    out[step] = [now - last[0], req - last[1], hit - last[2]]
    last[:] = [now, req, hit]
import kvjax
mark("import")
model_name, tokens = sys.argv[1], int(sys.argv[2])
questions = json.loads(sys.argv[3])
if model_name == "random":
    from kvjax.config_files import load_config
    config = load_config(sys.argv[4]).model
    params, tokenizer, template = kvjax.init_params(config, seed=0), None, None
else:
    model = kvjax.models.load(model_name)
    config, params = model.config, model.params
    tokenizer, template = model.tokenizer, model.template
mark("load")
engine = kvjax.Engine(params, config, tokenizer=tokenizer, chat_template=template)
mark("engine")
if sys.argv[5] == "1":
    engine.warmup()
mark("warm-up")
for step, question in zip(("first answer", "second answer"), questions):
    if tokenizer is None:  # a random model: prompts of the questions' lengths in characters
        request = kvjax.Request(tokens=[(7 * i) % config.vocab_size + 1
                                        for i in range(len(question))],
                                max_new_tokens=tokens)
    else:
        request = kvjax.Request(messages=[{"role": "user", "content": question}],
                                max_new_tokens=tokens)
    engine.generate([request])
    mark(step)
sys.stdout.write(json.dumps(out) + "\\n")
"""


def run_child(model: str, tokens: int, config: str, cache: str, environ=os.environ,
              warmup: bool = True) -> dict:
    """One fresh process's step table ({step: (seconds, requests, hits)}) with its XLA cache
    in `cache` (`warmup` False: no `Engine.warmup()`, its step empty)."""
    env = {k: v for k, v in environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["KVJAX_XLA_CACHE"] = cache
    proc = subprocess.run([sys.executable, "-c", CHILD, model, str(tokens),
                           json.dumps(QUESTIONS), config, str(int(warmup))],
                          capture_output=True, text=True,
                          env=env, check=False, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the start-up child failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(model: str, tokens: int, config: str, reps: int, warmup: bool = True) -> dict:
    """{"cold": runs, "warm": runs}: `reps` pairs, each a cold run into an empty folder and
    a warm run from what it wrote."""
    runs = {"cold": [], "warm": []}
    for _ in range(reps):
        with tempfile.TemporaryDirectory(prefix="kvjax-startup-") as cache:
            for kind in runs:
                runs[kind].append(run_child(model, tokens, config, cache, warmup=warmup))
    return runs


def table(runs: dict) -> list[dict]:
    """One row per step: the median seconds cold and warm, the programs asked for and those
    the cache gave back (from the first pair)."""
    rows = []
    for step in STEPS:
        row = {"step": step}
        for kind, got in runs.items():
            row[f"{kind} s"] = statistics.median(r[step][0] for r in got)
            row[f"{kind} programs"], row[f"{kind} from cache"] = got[0][step][1:]
        rows.append(row)
    return rows


COLUMNS = [("step", lambda r: r["step"])] + [
    (f"{kind} {what}", lambda r, k=f"{kind} {key}", f=fmt: f.format(r[k]))
    for kind in ("cold", "warm")
    for what, key, fmt in (("s", "s", "{:.2f}"), ("programs", "programs", "{}"),
                           ("from cache", "from cache", "{}"))]


def main(args) -> int:
    model = args.model or "smollm2-135m-instruct"
    warmup = not args.no_warmup
    emit(f"start-up of a new process: {model}, {args.gen_tokens} tokens per answer, "
         f"{args.reps} cold/warm pair(s), medians, warm-up {'on' if warmup else 'off'}")
    runs = measure(model, args.gen_tokens, args.config, args.reps, warmup)
    rows = table(runs)
    write_results(args.out, markdown_table(rows, COLUMNS), rows, model=model,
                  gen_tokens=args.gen_tokens, warmup=warmup, runs=runs)
    return 0
