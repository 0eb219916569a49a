"""Self-distillation windows for the EAGLE-style head (`kvjax.train.own_answers`): each row is
a prompt and the target's own greedy answer to it, the answer kept on disk and reused only
while the prompts, the window and the target are the same."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import sharp_params, small_model

from kvjax.data.chat import Conversation
from kvjax.model.transformer import forward
from kvjax.train import own_answers
from kvjax.train.own_answers import own_windows, prompts_of

SEQ = 40  # windows of 41 tokens: prompts of at most 20
STOP = 7


class _Template:
    """Renders each message as a role id and its text's bytes folded into the vocabulary."""

    def render(self, messages, add_generation_prompt=True):
        ids = [1]
        for m in messages:
            ids += [2 if m["role"] == "user" else 3] + [10 + b % 50 for b in
                                                        m["content"].encode()]
        return ids + [3] * add_generation_prompt


@dataclasses.dataclass
class _Model:
    params: dict
    config: object
    template: _Template = dataclasses.field(default_factory=_Template)
    stop_tokens: tuple = (STOP,)


@pytest.fixture(scope="module")
def model():
    config = small_model(max_seq_len=64)
    return _Model(sharp_params(config, seed=3), config)


TEXTS = ["hello there", "two and two", "x" * 30, "tell me a story", "ok", "why",
         "about paging", "bye"]
CONVERSATIONS = [Conversation(str(i), (("user", t), ("assistant", "recorded answer")))
                 for i, t in enumerate(TEXTS)]


def test_a_window_is_a_prompt_and_the_target_s_own_greedy_answer(model, tmp_path):
    prompts = prompts_of(model, CONVERSATIONS, SEQ)
    assert len(prompts) == 7  # "x" * 30 renders to 34 tokens, past half the window
    tokens, real, said = own_windows(model, CONVERSATIONS, SEQ, "t", tmp_path, limit=6)
    assert tokens.shape == real.shape == said.shape == (6, SEQ + 1)
    stopped = 0
    for row, prompt in enumerate(prompts[:6]):
        n = int(real[row].sum())
        assert real[row, :n].all() and not real[row, n:].any()
        assert tokens[row, :len(prompt)].tolist() == prompt
        assert said[row].tolist() == [len(prompt) <= i < n for i in range(SEQ + 1)]
        answer = tokens[row, len(prompt):n].tolist()
        # by induction on the answer: each token is the full-sequence pass's argmax after
        # the ones before it, so it is what greedy decoding of the prompt gives
        logits = np.asarray(forward(model.params, model.config,
                                    np.asarray([tokens[row, :n]]))[0])
        assert logits[len(prompt) - 1:n - 1].argmax(-1).tolist() == answer
        # it ends at the stop token (kept) or at the window's end, not before
        assert STOP not in answer[:-1]
        assert answer[-1] == STOP or n == SEQ + 1
        stopped += answer[-1] == STOP
    assert 0 < stopped < 6  # both endings occur (seen: 1 stop)


def test_answers_are_reused_only_for_the_same_prompts_window_and_target(model, tmp_path,
                                                                       monkeypatch):
    first = own_windows(model, CONVERSATIONS, SEQ, "t", tmp_path, limit=4)
    calls = []

    def fake(model, prompts, seq_len, log=print):
        calls.append(len(prompts))
        return [[STOP]] * len(prompts)

    monkeypatch.setattr(own_answers, "answer", fake)
    again = own_windows(model, CONVERSATIONS, SEQ, "t", tmp_path, limit=4)
    assert calls == []
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    own_windows(model, CONVERSATIONS, SEQ, "another target", tmp_path, limit=4)
    own_windows(model, CONVERSATIONS, SEQ, "another target", tmp_path, limit=5)
    own_windows(model, CONVERSATIONS, SEQ - 2, "another target", tmp_path, limit=5)
    other_stop = dataclasses.replace(model, stop_tokens=(STOP, 9))
    own_windows(other_stop, CONVERSATIONS, SEQ - 2, "another target", tmp_path, limit=5)
    assert calls == [4, 5, 5, 5]


def test_too_few_short_prompts_is_an_error(model, tmp_path):
    with pytest.raises(ValueError, match="8 prompts of at most 20 tokens asked for; 7 of 8"):
        own_windows(model, CONVERSATIONS, SEQ, "t", tmp_path, limit=8)
