"""`scripts/train_eagle`: an EAGLE-style head for a real model, trained on ShareGPT.

Each picked conversation (`kvjax.data.sharegpt`, the recorded answers: teacher-forced, as
the EAGLE paper trained) is rendered in the model's chat template, and its first
`seq_len + 1` tokens make one window: every window starts a conversation, so each feature
is the target's at the position and with the context it has when serving that text. The
loss counts on every real token, the user turns' too: EAGLE counts the answers only, but
with this little text (the features cost a target pass per token on this CPU) the more
positions the better, and predicting the target's next feature is the same task on a
user's text. Two settings: "short" (a few minutes: tests,
the quickstart) and "full" (about half an hour on two CPU cores, feature extraction
included). The head lands in `out/head` (`kvjax.speculative.eagle_file.load_head`).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from kvjax.config import TrainConfig
from kvjax.decode import compile_cache
from kvjax.lab.report import emit


@dataclasses.dataclass(frozen=True)
class EagleSetting:
    conversations: int  # training windows, one per ShareGPT conversation
    validation: int  # held-out conversations (after the training ones in the pick)
    seq_len: int
    draft_vocab: int
    train: TrainConfig
    # "recorded": ShareGPT's answers, teacher-forced; "own": the target's greedy answers to
    # the first user turns (`kvjax.train.own_answers`)
    answers: str = "recorded"
    # (feature, token), `head_loss`'s; None: its default, EAGLE's
    loss_weights: tuple[float, float] | None = None


SETTINGS = {
    "short": EagleSetting(conversations=32, validation=8, seq_len=128, draft_vocab=4096,
                          train=TrainConfig(steps=60, batch_size=4, learning_rate=1e-3,
                                            warmup_steps=10, eval_every=30,
                                            checkpoint_every=30, time_limit_s=90)),
    "full": EagleSetting(conversations=640, validation=32, seq_len=384, draft_vocab=8192,
                         train=TrainConfig(steps=480, batch_size=8, learning_rate=1e-3,
                                           warmup_steps=30, eval_every=120,
                                           checkpoint_every=120, time_limit_s=1200)),
}


def windows(model, conversations, seq_len: int) -> tuple[np.ndarray, np.ndarray,
                                                          np.ndarray]:
    """(tokens int32[N, seq_len + 1], real bool[N, seq_len + 1], answers bool[N, seq_len +
    1]): each conversation's first seq_len + 1 rendered tokens (zero-padded), where they
    are real (not padding) and where its answers' tokens are."""
    template = model.template
    tokens = np.zeros((len(conversations), seq_len + 1), np.int32)
    real, answers = np.zeros(tokens.shape, bool), np.zeros(tokens.shape, bool)
    for row, c in enumerate(conversations):
        messages = c.messages
        ids = template.render(messages, add_generation_prompt=False)[:seq_len + 1]
        tokens[row, :len(ids)] = ids
        real[row, :len(ids)] = True
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(template.render(messages[:i], add_generation_prompt=True))
            if start >= len(ids):
                break
            end = len(template.render(messages[:i + 1], add_generation_prompt=False))
            answers[row, start:min(end, len(ids))] = True
    return tokens, real, answers


def train_eagle(model_name: str, setting: EagleSetting, out_dir: str, resume: bool = True,
                log=print) -> dict:
    """Trains the head of `model_name` (`kvjax.models`) with `setting` into `out_dir`."""
    from kvjax import models
    from kvjax.data.sharegpt import sharegpt
    from kvjax.train.eagle import train_head

    t0 = time.perf_counter()
    model = models.load(model_name)
    n, want = setting.conversations, setting.conversations + setting.validation
    if setting.answers == "own":
        from kvjax.cache.identity import model_fingerprint
        from kvjax.train.own_answers import own_windows

        # a prompt past its share of the window is left out: pick more, keep the first
        picked = sharegpt(4 * want, max_turns=1, seed=setting.train.seed)
        tokens, mask, answers = own_windows(
            model, picked.conversations, setting.seq_len,
            model_fingerprint(model.config, model.params), Path(out_dir), limit=want, log=log)
    else:
        picked = sharegpt(want, seed=setting.train.seed)
        # the loss counts on every real token (module docstring)
        tokens, mask, answers = windows(model, picked.conversations, setting.seq_len)
    log(f"eagle: {model_name}, {n} + {setting.validation} ShareGPT windows ({setting.answers} "
        f"answers) of "
        f"{setting.seq_len + 1} tokens ({int(mask[:n].sum()):,} tokens to learn, "
        f"{int(answers[:n].sum()):,} of them answers'), "
        f"draft vocabulary {setting.draft_vocab}, {setting.train.steps} steps of "
        f"{setting.train.batch_size}")
    result = train_head(model.params, model.config, (tokens[:n], mask[:n]),
                        (tokens[n:], mask[n:]), setting.train, setting.draft_vocab, out_dir,
                        keep=model.stop_tokens, resume=resume, log=log, metadata={
                            "model": model_name, "data": picked.source,
                            "setting": dataclasses.asdict(setting)},
                        **({"weights": setting.loss_weights} if setting.loss_weights else {}))
    result["total_seconds"] = time.perf_counter() - t0
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train_eagle", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="full")
    parser.add_argument("--out", help="output folder (default: checkpoints/eagle-SETTING, "
                                          "-N for --conversations N, -own for --answers "
                                          "own)")
    parser.add_argument("--answers", choices=("recorded", "own"),
                        help="the windows' answers: ShareGPT's recorded ones or the target's "
                             "own greedy ones (default: the setting's)")
    parser.add_argument("--conversations", type=int,
                        help="training windows, one per ShareGPT conversation (default: the "
                             "setting's; the held-out ones follow them in the same pick, so "
                             "another N validates on other conversations)")
    parser.add_argument("--steps", type=int, help="training steps (default: the setting's)")
    parser.add_argument("--time-limit", type=float,
                        help="seconds of training before it checkpoints and stops "
                             "(default: the setting's)")
    parser.add_argument("--loss-weights", type=float, nargs=2, metavar=("FEATURE", "TOKEN"),
                        help="the loss's feature and token weights (default: EAGLE's 1 0.1; "
                             "EAGLE-3's token loss alone is 0 1)")
    parser.add_argument("--no-resume", action="store_true", help="start over")
    return parser


def setting_of(args: argparse.Namespace) -> EagleSetting:
    """The named setting with the command line's changes; a value of 0 is a value, not a
    default."""
    setting = SETTINGS[args.setting]
    if args.conversations is not None:
        if args.conversations < 1:
            raise SystemExit(f"--conversations must be at least 1, not {args.conversations}")
        setting = dataclasses.replace(setting, conversations=args.conversations)
    if args.answers:
        setting = dataclasses.replace(setting, answers=args.answers)
    if args.loss_weights:
        setting = dataclasses.replace(setting, loss_weights=tuple(args.loss_weights))
    train = setting.train
    if args.steps is not None:
        train = dataclasses.replace(train, steps=args.steps)
    if args.time_limit is not None:
        train = dataclasses.replace(train, time_limit_s=args.time_limit)
    return dataclasses.replace(setting, train=train)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    compile_cache.enable()
    setting = setting_of(args)
    own = "-own" if setting.answers == "own" else ""
    more = (f"-{setting.conversations}"
            if setting.conversations != SETTINGS[args.setting].conversations else "")
    out = args.out or f"checkpoints/eagle-{args.setting}{more}{own}"
    result = train_eagle(args.model, setting, out, not args.no_resume)
    val = result["validation"]
    emit(f"done: step {result['step']}, validation loss {val['loss']:.4f}, top-1 "
          f"{val['top1']:.3f} ({result['data_seconds']:.0f} s of features, "
          f"{result['train_seconds']:.0f} s of training, {result['total_seconds']:.0f} s "
          f"in all); head in {result['out']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
