"""Where answers end: a request's stop ids, the engine's `eos_tokens` (the checkpoint's
end-of-sequence ids, a default every request gets unless it sets `ignore_eos`; not given,
its tokenizer's), its stop strings (in the decoded text, across token boundaries), on the
plain and the speculative loop; a stopped sequence's pages go back and its full pages stay
cached."""

from __future__ import annotations

import dataclasses
import json

import pytest
from engine_helpers import CACHE, CONFIG, CONTEXT, SLOTS, params

from kvjax import Engine, EngineConfig, InvalidRequestError, Request
from kvjax.config import SpecConfig
from kvjax.decode import steps
from kvjax.engine.requests import MAX_STOP_TOKENS
from kvjax.io.tokenizer import ByteTokenizer, load_tokenizer

PROMPT = [5, 9, 2, 44, 17, 3, 8, 30, 12]
NEW = 24


@pytest.fixture(scope="module")
def p():
    return params()


def _engine(p, eos=None, spec=None, tokenizer=None) -> Engine:
    ec = EngineConfig(cache=CACHE, max_slots=SLOTS, decode_steps=4, min_context=CONTEXT)
    return Engine(p, CONFIG, ec, spec=spec, eos_tokens=eos, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def plain(p):
    """The greedy answer with no stop at all, and two ids it produces (first at 5, 11)."""
    tokens = _engine(p).generate([Request(PROMPT, NEW)])[0].tokens
    first = [t for i, t in enumerate(tokens) if t not in tokens[:i]]
    a, b = first[2], first[4]
    return tokens, a, b


def _cut(tokens, stops):
    """tokens up to and including the first of `stops`."""
    end = next(i for i, t in enumerate(tokens) if t in stops)
    return tokens[: end + 1]


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_answers_end_at_the_first_of_their_stop_ids(p, plain, drafter):
    tokens, a, b = plain
    spec = None if drafter is None else SpecConfig(drafter=drafter, gamma=3)
    eng = _engine(p, eos=(a,), spec=spec)  # a comes first in the answer, b later
    got = eng.generate([Request(PROMPT, NEW, stop_tokens=[b]),  # stops (b, a): a ends it
                        Request(PROMPT, NEW),  # eos only
                        Request(PROMPT, NEW, stop_tokens=[b], ignore_eos=True),
                        Request(PROMPT, NEW, ignore_eos=True)])  # no stop at all
    assert got[0].tokens == _cut(tokens, {a}) == got[1].tokens
    assert got[2].tokens == _cut(tokens, {b}) != got[0].tokens
    assert got[3].tokens == tokens and len(tokens) == NEW


def test_any_number_of_stop_ids_compiles_no_new_decode_loop(p, plain):
    """The decode loop checks a fixed [batch, 8] stop table: after a warm-up, requests with
    0, 1, 3 and 8 stop ids trace no new decode loop, and each ends at the first of its ids."""
    tokens, a, b = plain
    eng = _engine(p)
    eng.generate([Request(PROMPT, NEW)])  # every shape this answer's decode calls have
    before = steps.trace_counts()["decode_loop"]
    absent = [t for t in range(CONFIG.vocab_size) if t not in tokens]
    for stops in ([], [b], [absent[0], a, absent[1]], absent[:MAX_STOP_TOKENS - 1] + [b]):
        (got,) = eng.generate([Request(PROMPT, NEW, stop_tokens=stops)])
        assert got.tokens == (_cut(tokens, set(stops)) if stops else tokens)
    assert steps.trace_counts()["decode_loop"] == before


def test_a_stopped_answer_gives_back_its_pages_and_caches_its_full_ones(p, plain):
    _, _, b = plain
    eng = _engine(p, eos=(b,))
    (result,) = eng.generate([Request(PROMPT, NEW)])
    assert result.tokens[-1] == b and len(result.tokens) < NEW
    history = len(PROMPT) + len(result.tokens) - 1  # the last token is never cached
    assert eng.trie.num_nodes == history // CACHE.page_size
    assert eng.allocator.num_free == CACHE.num_pages - eng.trie.num_nodes
    follow = PROMPT + result.tokens + [7]
    (again,) = eng.generate([Request(follow, 2)])
    assert again.stats["reused_tokens"] == history // CACHE.page_size * CACHE.page_size


def test_bad_stop_ids_are_clear_errors(p):
    eng = _engine(p, eos=(1, 2))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        eng.generate([Request(PROMPT, 2, stop_tokens=[CONFIG.vocab_size])])
    with pytest.raises(InvalidRequestError, match="stop_tokens must be a list of ints"):
        eng.generate([Request(PROMPT, 2, stop_tokens=3)])
    many = list(range(3, 3 + MAX_STOP_TOKENS - 1))
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_TOKENS}"):
        eng.generate([Request(PROMPT, 2, stop_tokens=many)])
    eng.generate([dataclasses.replace(Request(PROMPT, 2, stop_tokens=many), ignore_eos=True)])
    assert eng.allocator.num_free == CACHE.num_pages - eng.trie.num_nodes
    with pytest.raises(ValueError, match="eos_tokens"):
        _engine(p, eos=(CONFIG.vocab_size,))


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_stop_strings_end_answers_across_token_boundaries(p, plain, drafter):
    """Byte tokens: a 3-character stop string spans 3 tokens. The answer ends with the token
    that completes its first occurrence (mid-call: 4 tokens a call), nothing past it is
    streamed or cached, and its full pages are reused by a follow-up."""
    tokens, _, _ = plain
    tok = ByteTokenizer(special_tokens=())
    text = tok.decode(tokens)
    stop = text[7:10]
    keep = text.index(stop) + len(stop)  # one character per token
    assert keep % 4 != 0  # the cut falls inside a decode call
    spec = None if drafter is None else SpecConfig(drafter=drafter, gamma=3)
    eng = _engine(p, spec=spec, tokenizer=tok)
    rid = eng.submit(Request(PROMPT, NEW, stop_strings=["never there", stop],
                             return_logits=True))
    streamed = [t for e in eng.stream(rid) for t in e.tokens]
    (again,) = eng.generate([Request(PROMPT, NEW, stop_strings=[stop])])
    assert streamed == tokens[:keep] == again.tokens
    assert again.text.endswith(stop) and again.text.count(stop) == 1
    history = len(PROMPT) + keep - 1
    assert eng.trie.num_nodes == history // CACHE.page_size
    assert eng.allocator.num_free == CACHE.num_pages - eng.trie.num_nodes
    (follow,) = eng.generate([Request(PROMPT + again.tokens + [7], 2)])
    assert follow.stats["reused_tokens"] == history // CACHE.page_size * CACHE.page_size


def test_stop_strings_need_a_tokenizer_and_must_be_strings(p):
    with pytest.raises(InvalidRequestError, match="stop_strings need an engine with a tok"):
        _engine(p).generate([Request(PROMPT, 2, stop_strings=["x"])])
    eng = _engine(p, tokenizer=ByteTokenizer(special_tokens=()))
    for bad in (["x", ""], "x", [3]):
        with pytest.raises(InvalidRequestError, match="stop_strings must be a list of non-emp"):
            eng.generate([Request(PROMPT, 2, stop_strings=bad)])
    assert eng.allocator.num_free == CACHE.num_pages


def _tokenizer_folder(folder, eos_token: str, generation_eos=None):
    """A word-level tokenizer.json over the model's ids ("t0" ... "t60") in `folder`, with
    `eos_token` in tokenizer_config.json and, if given, `generation_eos` as
    generation_config.json's eos_token_id."""
    from tokenizers import Tokenizer, models

    folder.mkdir()
    vocab = {f"t{i}": i for i in range(CONFIG.vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token}))
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": generation_eos}))
    return folder


def test_an_engine_stops_at_its_tokenizers_eos_unless_told_otherwise(p, plain, tmp_path):
    """Without `eos_tokens`, an engine stops at its tokenizer's `eos_ids`: the EOS token's id
    (b) and generation_config.json's list (a, b; a comes first in the answer). An explicit
    tuple replaces them, () stops at none, and `ignore_eos` still overrides."""
    tokens, a, b = plain
    tok, _ = load_tokenizer(_tokenizer_folder(tmp_path / "gen", f"t{b}", [a, b]))
    assert tok.eos_ids == (b, a)
    default = _engine(p, tokenizer=tok)
    assert default.eos_tokens == (b, a)
    got = default.generate([Request(PROMPT, NEW), Request(PROMPT, NEW, ignore_eos=True)])
    assert got[0].tokens == _cut(tokens, {a}) and got[1].tokens == tokens
    (explicit,) = _engine(p, eos=(b,), tokenizer=tok).generate([Request(PROMPT, NEW)])
    assert explicit.tokens == _cut(tokens, {b}) != got[0].tokens
    (none,) = _engine(p, eos=(), tokenizer=tok).generate([Request(PROMPT, NEW)])
    assert none.tokens == tokens and len(tokens) == NEW
    eos_only, _ = load_tokenizer(_tokenizer_folder(tmp_path / "eos", f"t{b}"))
    assert eos_only.eos_ids == (b,)
    (only,) = _engine(p, tokenizer=eos_only).generate([Request(PROMPT, NEW)])
    assert only.tokens == _cut(tokens, {b}) and len(only.tokens) < NEW


def test_a_tokenizer_eos_the_model_cannot_produce_is_left_out(p):
    """The byte tokenizer's <|eos|> (257) is past this model's 61 ids: never sampled, so not
    a default stop; named explicitly it is an error."""
    assert ByteTokenizer().eos_ids == (257,)
    assert _engine(p, tokenizer=ByteTokenizer()).eos_tokens == ()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _engine(p, eos=(257,), tokenizer=ByteTokenizer())


def test_a_tokenizer_without_eos_ids_gives_no_default_stop(p):
    """A tokenizer written to the protocol before it had `eos_ids` still serves."""

    class Older:
        vocab_size, bos_token, eos_token = 61, None, None

    assert _engine(p, tokenizer=Older()).eos_tokens == ()
