"""Runs in llama.cpp's own environment (standard library and `llama_cpp` only): greedy
generation from token-id prompts, timed; prints one JSON line (see kvjax.bench.llamacpp).

With a "prefix" argument ({"shared": ids, "suffixes": [ids, ...]}) it also times one-token
requests of the shared prefix plus each suffix: cold (an empty cache each time) and warm
(the previous request's cache kept: llama-cpp-python reuses the longest common prefix).
With "logits" (a .npy path), the first prompt and its greedy tokens are evaluated once more
with every position's logits kept, and the rows of the generated tokens' steps saved there
([new_tokens, vocab] float32)."""

import json
import statistics
import sys
import time

from llama_cpp import Llama


def timed(llm, prompt: list, n: int, reset: bool = True) -> tuple[float, list]:
    """Seconds and tokens of `n` greedy tokens after `prompt`, from an empty cache (`reset`)
    or from what the previous call left in it."""
    if reset:
        llm.reset()  # no prefix reuse: every run prefills the whole prompt
    tokens, start = [], time.perf_counter()
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == n:
            break
    return time.perf_counter() - start, tokens


def prefix_times(llm, shared: list, suffixes: list) -> dict:
    """Median seconds of a one-token request of `shared` + each suffix, cold and warm."""
    cold = [timed(llm, shared + s, 1)[0] for s in suffixes]
    timed(llm, shared + suffixes[0], 1)  # the shared prefix is now cached
    warm = [timed(llm, shared + s, 1, reset=False)[0] for s in suffixes[1:]]
    return {"cold_s": statistics.median(cold), "warm_s": statistics.median(warm)}


def save_logits(llm, prompt: list, tokens: list, path: str) -> None:
    """The logits llama.cpp gives at each step that chose `tokens` after `prompt`."""
    import numpy as np  # llama-cpp-python's own dependency

    llm.reset()
    llm.eval(prompt + tokens[:-1])
    rows = np.asarray(llm.scores[len(prompt) - 1:len(prompt) - 1 + len(tokens)], np.float32)
    np.save(path, rows)


def main() -> None:
    args = json.loads(sys.argv[1])
    prefix = args.get("prefix")
    longest = max(map(len, args["prompts"])) + args["new_tokens"]
    if prefix:
        longest = max(longest, len(prefix["shared"]) + max(map(len, prefix["suffixes"])) + 2)
    llm = Llama(model_path=args["model"], n_ctx=longest + 16, n_batch=512,
                n_threads=args["threads"], n_threads_batch=args["threads"], verbose=False,
                logits_all=bool(args.get("logits")))
    rows = []
    for prompt in args["prompts"]:
        timed(llm, prompt, 2)  # warm-up
        prefill = statistics.median(timed(llm, prompt, 1)[0] for _ in range(args["reps"]))
        runs = [timed(llm, prompt, args["new_tokens"]) for _ in range(args["reps"])]
        total = statistics.median(t for t, _ in runs)
        rows.append({"prefill_s": prefill, "total_s": total, "tokens": runs[0][1]})
    if prefix:
        rows[0] |= prefix_times(llm, prefix["shared"], prefix["suffixes"])
    if args.get("logits"):
        save_logits(llm, args["prompts"][0], rows[0]["tokens"], args["logits"])
    sys.stdout.write(json.dumps(rows) + "\n")  # the reply: the parent reads the last line


if __name__ == "__main__":
    main()
