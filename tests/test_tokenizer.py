"""Tokenizers and chat templates: the cache identity is the rendered ids, never the text."""

from __future__ import annotations

import json
import unicodedata

import pytest
from engine_helpers import assert_same

import kvjax
from kvjax import CacheConfig, Engine, EngineConfig, ModelConfig, Request
from kvjax.io.tokenizer import (
    BYTE_CHAT_TEMPLATE,
    ByteTokenizer,
    ChatTemplate,
    ChatTemplateError,
    load_tokenizer,
)

CONFIG = ModelConfig(vocab_size=264, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                     d_ff=64, max_seq_len=256)
CACHE = CacheConfig(page_size=4, num_pages=96, prefill_chunk=16, attn_block=8)


@pytest.fixture(scope="module")
def params():
    return kvjax.init_params(CONFIG, seed=2)


def _engine(params, tokenizer, template=None):
    return Engine(params, CONFIG, EngineConfig(cache=CACHE, max_slots=4, decode_steps=4),
                  tokenizer=tokenizer, chat_template=template)


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "<|bos|>héllo <|user|>wörld<|end|>"
    ids = tok.encode(text)
    assert ids[0] == 256 and 260 in ids and 262 in ids
    assert tok.decode(ids) == text
    assert tok.encode("abc") == [97, 98, 99]
    assert tok.vocab_size == 264


def test_lookalike_texts_get_no_false_reuse(params):
    """'café' composed (é = U+00E9) and decomposed (e + U+0301) look the same but encode
    differently: the second request reuses only pages inside the common id prefix, and its
    output is its own cold output."""
    tok = ByteTokenizer()
    head = "The quick brown fox visited a "
    composed = head + unicodedata.normalize("NFC", "café") + " and ordered tea."
    decomposed = head + unicodedata.normalize("NFD", "café") + " and ordered tea."
    assert composed != decomposed and unicodedata.normalize("NFC", decomposed) == composed
    a_ids, b_ids = tok.encode(composed), tok.encode(decomposed)
    common = _common_prefix(a_ids, b_ids)
    eng = _engine(params, tok)
    eng.generate([Request(text=composed, max_new_tokens=4)])
    (b,) = eng.generate([Request(text=decomposed, max_new_tokens=4, return_logits=True)])
    assert b.prompt_ids == b_ids
    assert b.stats["reused_tokens"] == common // 4 * 4
    assert b.stats["miss_cause"] == "divergence"
    assert b.stats["miss_position"] == common
    assert_same([b], _engine(params, tok).generate([Request(text=decomposed, max_new_tokens=4,
                                                            return_logits=True)]))
    assert b.text == tok.decode(b.tokens)


def test_hf_tokenizer_json_and_chat_template(params, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|tool|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["hello world, hello there", "the weather is nice today", "tools and users"] * 20
    bpe.train_from_iterator(corpus, trainer)
    bpe.save(str(tmp_path / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}))
    tok, chat = load_tokenizer(tmp_path)
    assert tok.vocab_size <= CONFIG.vocab_size
    assert tok.decode(tok.encode("hello world")) == "hello world"

    system = {"role": "user", "content": "hello there, the weather is nice today"}
    as_user = [system, {"role": "user", "content": "hello world"}]
    as_tool = [system, {"role": "tool", "content": "hello world"}]
    user_ids, tool_ids = chat.render(as_user), chat.render(as_tool)
    common = _common_prefix(user_ids, tool_ids)
    assert user_ids[common] == tok.token_id("<|user|>")
    assert tool_ids[common] == tok.token_id("<|tool|>")
    assert user_ids[common + 1:] == tool_ids[common + 1:]  # only the control token differs

    eng = _engine(params, tok, chat)
    eng.generate([Request(messages=as_user, max_new_tokens=3)])
    (b,) = eng.generate([Request(messages=as_tool, max_new_tokens=3, return_logits=True)])
    assert b.prompt_ids == tool_ids
    assert b.stats["reused_tokens"] == common // 4 * 4  # nothing beyond the divergence
    assert_same([b], _engine(params, tok, chat).generate(
        [Request(messages=as_tool, max_new_tokens=3, return_logits=True)]))


def test_byte_chat_template_and_request_errors(params):
    tok = ByteTokenizer()
    chat = ChatTemplate(BYTE_CHAT_TEMPLATE, tok)
    ids = chat.render([{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "<|bos|><|user|>hi<|end|><|assistant|>"
    eng = _engine(params, tok)
    with pytest.raises(kvjax.InvalidRequestError, match="chat template"):
        eng.submit(Request(messages=[{"role": "user", "content": "hi"}]))
    with pytest.raises(kvjax.InvalidRequestError, match="exactly one"):
        eng.submit(Request(tokens=[1, 2], text="hi"))
    with pytest.raises(kvjax.InvalidRequestError, match="tokenizer"):
        _engine(params, None).submit(Request(text="hi"))
    with pytest.raises(kvjax.InvalidRequestError, match="'role'"):
        _engine(params, tok, chat).submit(Request(messages=[{"content": "hi"}]))


HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def serving(params):
    """One engine shared by the failing-template cases, and the tokens a valid request gets
    from it while it is fresh."""
    eng = _engine(params, ByteTokenizer())
    (fresh,) = eng.generate([Request(text="still serving", max_new_tokens=4)])
    return eng, fresh.tokens


@pytest.mark.parametrize(("source", "messages", "match"), [
    pytest.param("{% for m in messages %}\n{{ m['name'].upper() }}{% endfor %}", HI,
                 "UndefinedError at line 2: 'dict object' has no attribute 'name'",
                 id="undefined-field"),
    pytest.param("{% for m in messages %}\n\n{{ m['tool_calls'] | join(', ') }}{% endfor %}",
                 [{"role": "user", "content": "hi", "tool_calls": 5}],
                 "TypeError at line 3: 'int' object is not iterable", id="type-error-in-filter"),
    pytest.param("{% set roles = [] %}\n{% for m in messages %}{{ roles.append(m['role']) }}"
                 "{% endfor %}", HI,
                 "SecurityError at line 2: access to attribute 'append' of 'list'",
                 id="sandbox"),
    pytest.param("{% for m in messages %}{{ '{0}: {1}'.format(m['content']) }}{% endfor %}", HI,
                 "IndexError at line 1", id="index-error"),
    pytest.param("{% if messages[0]['role'] != 'system' %}"
                 "{{ raise_exception('the first message must be the system prompt') }}"
                 "{% endif %}", HI, "^chat template: the first message must be the system prompt$",
                 id="raise-exception"),
    pytest.param(BYTE_CHAT_TEMPLATE, "hi", "messages must be a list of messages, got str",
                 id="messages-a-string"),
    pytest.param(BYTE_CHAT_TEMPLATE, [("user", "hi")], "message 0 must be a dict",
                 id="message-a-tuple"),
    pytest.param(BYTE_CHAT_TEMPLATE, [*HI, {"content": "hi"}],
                 "message 1 has no 'role'", id="no-role"),
    pytest.param(BYTE_CHAT_TEMPLATE, [{"role": "user", "content": 5}],
                 r"message 0 needs a string 'content' \(or a list of parts, or null beside "
                 r"'tool_calls'\), got int", id="content-an-int"),
    pytest.param(BYTE_CHAT_TEMPLATE, [{"role": "user", "content": None}],
                 "message 0 needs a string 'content'.*got NoneType", id="content-none"),
    pytest.param(BYTE_CHAT_TEMPLATE, [{"role": "user"}], "message 0 has no 'content'",
                 id="no-content"),
])
def test_chat_template_failures_are_invalid_requests(serving, source, messages, match):
    """Every way a template or its messages can fail is an InvalidRequestError naming the
    problem, and the engine serves the next request as if nothing happened."""
    eng, expected = serving
    tok = eng.tokenizer
    eng.chat_template = ChatTemplate(source, tok)
    with pytest.raises(kvjax.InvalidRequestError, match=match):
        eng.submit(Request(messages=messages, max_new_tokens=4))
    assert eng.num_waiting == 0 and eng.num_running == 0
    (after,) = eng.generate([Request(text="still serving", max_new_tokens=4)])
    assert after.tokens == expected
    m = eng.metrics()
    assert m["free_pages"] == CACHE.num_pages - m["resident_pages"]


def test_chat_template_that_does_not_compile_fails_at_construction(tmp_path):
    source = "{% for m in messages %}\n{{ m['content'] }"
    with pytest.raises(ChatTemplateError, match="does not compile: line 2: unexpected '}'"):
        ChatTemplate(source, ByteTokenizer())
    tokenizers = pytest.importorskip("tokenizers")
    tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json: chat template does not "
                                                "compile: line 2"):
        load_tokenizer(tmp_path)


def test_chat_templates_from_their_three_homes(tmp_path):
    """`chat_template.jinja` (transformers 5; it wins over tokenizer_config.json), a list of
    named templates in tokenizer_config.json (the "default" one), and none at all."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1, "b": 2},
                                                     unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json"))
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "b"}, {"name": "default", "template": "a"}]}))
    assert load_tokenizer(tmp_path)[1].render_text([]) == "a"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}b")
    assert load_tokenizer(tmp_path)[1].render_text([{"role": "user", "content": "x"}]) == "xb"
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ChatTemplateError, match="chat_template.jinja: chat template does not"):
        load_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "b"}]}))
    assert load_tokenizer(tmp_path)[1] is None


def test_eos_ids_from_the_tokenizer_and_its_folder(params, tmp_path):
    """A tokenizer's `eos_ids` (an engine's default `eos_tokens`): the byte tokenizer's
    <|eos|>; a folder's EOS token, then generation_config.json's eos_token_id (an id or a
    list), else config.json's, as transformers' `generate` reads them."""
    tok, _ = load_tokenizer("byte")
    assert tok.eos_ids == (257,) and ByteTokenizer(special_tokens=()).eos_ids == ()
    assert _engine(params, tok).eos_tokens == (257,)
    assert _engine(params, None).eos_tokens == ()
    import tokenizers
    tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "</s>": 1, "<|end|>": 2},
                                                     unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path)[0].eos_ids == ()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "</s>"}}))
    assert load_tokenizer(tmp_path)[0].eos_ids == (1,)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert load_tokenizer(tmp_path)[0].eos_ids == (1, 0)
    generation = tmp_path / "generation_config.json"
    generation.write_text(json.dumps({"eos_token_id": 2}))  # wins over config.json
    assert load_tokenizer(tmp_path)[0].eos_ids == (1, 2)
    generation.write_text(json.dumps({"eos_token_id": [2, 1, 2]}))
    tok, _ = load_tokenizer(tmp_path)
    assert tok.eos_ids == (1, 2)
    assert _engine(params, tok).eos_tokens == (1, 2)
