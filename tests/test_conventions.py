"""The ecosystem's generation conventions, checked against transformers itself: end-of-
sequence ids from generation_config.json / config.json, BOS for `Request(text=...)` as the
tokenizer specifies, stop strings across token boundaries, and chat templates with system
prompts, multi-turn history and tool calls rendered to the ids `apply_chat_template` gives.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the hf extra (scripts/test installs it)")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from test_hf import LLAMA, _randomize  # noqa: E402

import kvjax  # noqa: E402
from kvjax import CacheConfig, Engine, EngineConfig, Request  # noqa: E402
from kvjax.engine.stop_strings import stop_end  # noqa: E402
from kvjax.io.tokenizer import ChatTemplate, load_tokenizer  # noqa: E402

SPECIALS = ["<unk>", "<|begin|>", "<|end|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["hello world, hello there", "the weather is nice today", "tools and users",
          "get_weather city Paris Zürich", "You are a helpful assistant."] * 20


def _tokenizer_folder(folder, bos: bool):
    """A byte-level BPE tokenizer saved as transformers saves one; with `bos`, its
    post-processor adds <|begin|> to a prompt (as Llama 3's does)."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    bpe = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    if bos:
        bpe.post_processor = processors.TemplateProcessing(
            single="<|begin|> $A", special_tokens=[("<|begin|>", bpe.token_to_id("<|begin|>"))])
    folder.mkdir(parents=True, exist_ok=True)
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin|>", "eos_token": "<|end|>",
         "add_bos_token": not bos}))  # transformers 5 ignores it for byte-level BPE
    return folder


@pytest.fixture(scope="module")
def tok_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {bos: _tokenizer_folder(root / f"bos_{bos}", bos) for bos in (True, False)}


@pytest.mark.parametrize("bos", [True, False])
def test_text_prompts_get_the_special_tokens_the_tokenizer_adds(tok_folders, bos):
    folder = tok_folders[bos]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    tok, _ = load_tokenizer(folder)
    for text in ("hello world", "the weather in Zürich", "  two  spaces"):
        ids = hf(text)["input_ids"]
        assert tok.encode_prompt(text) == ids
        assert (ids[0] == tok.token_id("<|begin|>")) == bos
        assert tok.encode(text) == (ids[1:] if bos else ids)  # encode adds nothing


def test_stop_strings_are_found_across_multi_character_tokens(tok_folders):
    """A stop string that starts inside one BPE token and ends inside another, and a
    two-byte character whose bytes are separate tokens: the answer keeps the token that
    completes the string."""
    tok, _ = load_tokenizer(tok_folders[False])
    ids = tok.encode("hello world, hello there")
    ends = [len(tok.decode(ids[:m])) for m in range(1, len(ids) + 1)]  # text after token i
    begin = tok.decode(ids).index("lo wo")
    first = next(i for i, e in enumerate(ends) if e > begin)  # the token holding its "l"
    last = next(i for i, e in enumerate(ends) if e >= begin + len("lo wo"))
    assert first < last and (ends[first - 1] if first else 0) < begin  # starts mid-token
    end = last + 1
    assert stop_end(tok.decode, ids, 0, ["lo wo"]) == end < len(ids)
    assert stop_end(tok.decode, ids, 0, ["absent"]) is None
    umlaut = tok.encode("Zür")
    bytes_of_u = [i for i in umlaut if tok.decode([i]) in ("\ufffd", "ü")]
    assert stop_end(tok.decode, umlaut, 0, ["ü"]) == umlaut.index(bytes_of_u[-1]) + 1
    assert stop_end(tok.decode, ids, end, ["there"]) == len(ids)  # searched past `checked`


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A small random Llama, its greedy answer with no end-of-sequence at all, and the first
    three distinct ids of that answer after its second token."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        tie_word_embeddings=False, **LLAMA)).eval()
    _randomize(model)
    prompt = list(range(3, 14))
    with torch.no_grad():
        plain = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    later = list(dict.fromkeys(plain[2:]))[:3]
    return model, prompt, plain, later


def _answer(folder, prompt) -> list[int]:
    m = kvjax.models.load(folder)
    ec = EngineConfig(cache=CacheConfig(page_size=4, num_pages=64, prefill_chunk=16,
                                        attn_block=8), max_slots=2)
    eng = Engine(m.params, m.config, ec, eos_tokens=m.stop_tokens)
    return eng.generate([Request(prompt, 24)])[0].tokens, m.stop_tokens


def test_end_of_sequence_ids_come_from_generation_config_then_config(hf_model, tmp_path):
    """generation_config.json names three ids (as Llama 3's does) and wins over
    config.json's one; without it, config.json's. kvjax stops where transformers'
    generate stops, with the same tokens."""
    model, prompt, plain, (a, b, c) = hf_model
    model.config.eos_token_id = c
    model.generation_config.eos_token_id = [b, a, c]
    model.generation_config.pad_token_id = 0
    model.save_pretrained(tmp_path)
    assert (tmp_path / "generation_config.json").exists()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=24,
                             do_sample=False)[0, len(prompt):].tolist()
    got, stops = _answer(tmp_path, prompt)
    assert stops == (b, a, c)
    assert got == ref == plain[: plain.index(a) + 1]  # a comes first in the answer
    (tmp_path / "generation_config.json").unlink()
    got, stops = _answer(tmp_path, prompt)
    assert stops == (c,) and got == plain[: plain.index(c) + 1] != ref


# Qwen 2.5-style: a default system prompt or the tools block, tool calls and responses,
# `continue` past system messages, a date from strftime_now when there is no system prompt,
# assistant turns in a `{% generation %}` block
QWEN_LIKE = """{%- if tools %}
<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{%- elif messages[0]['role'] == 'system' %}
<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{%- else %}
<|im_start|>system
Today is {{ strftime_now('%d %B %Y') }}.<|im_end|>
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}{% continue %}{% endif %}
{%- if message['role'] == 'assistant' and message.tool_calls is defined %}
<|im_start|>assistant
{%- if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{%- elif message['role'] == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{%- elif message['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}
{%- else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{%- endif %}
"""
# Llama 3.1-style: BOS, tools as indented JSON in the first user turn, role alternation
# enforced by raise_exception, `break` after a tool response
LLAMA_LIKE = """{{- bos_token }}
{%- set ns = namespace(tools_done=false) %}
{%- for message in messages %}
{%- if loop.index0 > 0 and message['role'] == messages[loop.index0 - 1]['role'] %}
{{- raise_exception('roles must alternate') }}
{%- endif %}
<|im_start|>{{ message['role'] }}
{%- if tools and message['role'] == 'user' and not ns.tools_done %}
{%- set ns.tools_done = true %}
Functions:
{%- for t in tools %}
{{ t | tojson(indent=4) }}
{%- endfor %}
{%- endif %}
{%- if message.tool_calls is defined %}
{%- for call in message.tool_calls %}
{{ call.function | tojson }}
{%- endfor %}
{%- else %}
{{ message['content'] }}
{%- endif %}<|im_end|>
{%- if message['role'] == 'tool' and loop.last %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- endif %}
"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Die Temperatur in einer Stadt (°C), e.g. Zürich",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = {"role": "assistant", "tool_calls": [{"type": "function", "function": {
    "name": "get_weather", "arguments": {"city": "Zürich"}}}]}
CHATS = {
    "system": [{"role": "system", "content": "You are a helpful assistant."},
               {"role": "user", "content": "hello there"}],
    "no-system": [{"role": "user", "content": "hello world"}],
    "multi-turn": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "the weather is nice today"},
                   {"role": "assistant", "content": "It is."},
                   {"role": "user", "content": "tools and users?"}],
    "tool-calls": [{"role": "user", "content": "weather in Zürich?"}, CALL,
                   {"role": "tool", "content": "{\"temperature\": 21}"}],
}


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize(("name", "source"), [("qwen", QWEN_LIKE), ("llama", LLAMA_LIKE)])
@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["no-tools", "tools"])
def test_chat_template_ids_equal_apply_chat_template(tok_folders, chat, name, source, tools):
    folder = tok_folders[False]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    tok, _ = load_tokenizer(folder)
    messages = CHATS[chat]
    expected = hf.apply_chat_template(messages, tools=tools, chat_template=source,
                                      add_generation_prompt=True, tokenize=False)
    ids = hf.apply_chat_template(messages, tools=tools, chat_template=source,
                                 add_generation_prompt=True, tokenize=True, return_dict=False)
    template = ChatTemplate(source, tok)
    assert template.render_text(messages, tools=tools) == expected
    assert template.render(messages, tools=tools) == ids
    if tools:
        assert "Zürich" in expected and "°C" in expected  # tojson keeps them as they are


def test_a_template_error_is_an_invalid_request(tok_folders):
    tok, _ = load_tokenizer(tok_folders[False])
    config = kvjax.ModelConfig(vocab_size=tok.vocab_size, num_layers=1, d_model=16,
                               num_heads=2, num_kv_heads=2, d_ff=32, max_seq_len=1024)
    eng = Engine(kvjax.init_params(config), config,
                 EngineConfig(cache=CacheConfig(page_size=16, num_pages=64, prefill_chunk=64,
                                                attn_block=64), max_slots=1),
                 tokenizer=tok, chat_template=ChatTemplate(LLAMA_LIKE, tok))
    same_role = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(kvjax.InvalidRequestError, match="roles must alternate"):
        eng.submit(Request(messages=same_role, max_new_tokens=2))
    with pytest.raises(kvjax.InvalidRequestError, match="tools are listed by a chat template"):
        eng.submit(Request(text="a", tools=[WEATHER], max_new_tokens=2))
    (ok,) = eng.generate([Request(messages=CHATS["tool-calls"], tools=[WEATHER],
                                  max_new_tokens=2)])
    assert ok.prompt_ids == ChatTemplate(LLAMA_LIKE, tok).render(CHATS["tool-calls"],
                                                                 tools=[WEATHER])
    assert np.all(np.asarray(ok.tokens) < tok.vocab_size)
