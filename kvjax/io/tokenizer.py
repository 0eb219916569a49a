"""Text to token ids: a built-in byte-level tokenizer, `tokenizer.json` files through the
`tokenizers` library, and chat templates (Jinja, as in Hugging Face `tokenizer_config.json`).

The cache identity is always the rendered token ids, never the text: two texts that look
alike but encode differently share only their common id prefix.
"""

from __future__ import annotations

import datetime
import json
import re
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|end|>", "<|tool|>")

# A small default chat template for models that use the byte tokenizer.
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class Tokenizer(Protocol):
    vocab_size: int
    bos_token: str | None
    eos_token: str | None
    eos_ids: tuple[int, ...]  # where answers end: what `Engine` stops at unless told otherwise

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]:
        """A whole prompt's ids: `encode` plus the special tokens the tokenizer adds (BOS)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_id(self, token: str) -> int | None: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; special tokens follow (256 = <|bos|>, 257 = <|eos|>, ...).

    Special token strings in the text encode to their ids; everything else to its bytes.
    """

    def __init__(self, special_tokens: Sequence[str] = SPECIAL_TOKENS):
        self.special = {tok: 256 + i for i, tok in enumerate(special_tokens)}
        self.special_by_id = {i: tok for tok, i in self.special.items()}
        self.vocab_size = 256 + len(special_tokens)
        self.bos_token = "<|bos|>" if "<|bos|>" in self.special else None
        self.eos_token = "<|eos|>" if "<|eos|>" in self.special else None
        self.eos_ids = () if self.eos_token is None else (self.special[self.eos_token],)
        self._split = re.compile("(" + "|".join(map(re.escape, special_tokens)) + ")") \
            if special_tokens else None

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in (self._split.split(text) if self._split else [text]):
            if piece in self.special:
                ids.append(self.special[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def encode_prompt(self, text: str) -> list[int]:  # adds nothing
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", "replace"))
            buf = bytearray()
            out.append(self.special_by_id.get(i, ""))
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)

    def token_id(self, token: str) -> int | None:
        return self.special.get(token)


class HFTokenizer:
    """A `tokenizer.json` through the `tokenizers` library. `encode` adds no special tokens
    (a chat template writes its own); `encode_prompt` adds what the tokenizer's
    post-processor adds (a BOS, for Llama 3), as transformers 5's `tokenizer(text)` does
    for byte-level vocabularies (it ignores tokenizer_config.json's add_bos_token there).

    `eos_ids`: the id of `eos_token`, then the checkpoint's other end-of-sequence ids
    (`eos_ids` given here), as vLLM stops at both."""

    def __init__(self, source, bos_token: str | None = None, eos_token: str | None = None,
                 eos_ids: Sequence[int] = ()):
        """source: a `tokenizer.json` path or a `tokenizers.Tokenizer`; eos_ids: more
        end-of-sequence ids (a folder's generation_config.json, a GGUF file's EOT / EOM)."""
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:  # pragma: no cover
            raise ImportError("tokenizer.json files need the hf extra: pip install "
                              "'kvjax[hf]'") from e
        self._tok = source if isinstance(source, _Tokenizer) else \
            _Tokenizer.from_file(str(source))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token
        self.eos_token = eos_token
        eos = None if eos_token is None else self.token_id(eos_token)
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in
                                           ([] if eos is None else [eos]) + list(eos_ids)))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class ChatTemplateError(ValueError):
    """A chat template that does not compile, messages it cannot take, or a render that
    fails. A ValueError, so the engine reports it as an `InvalidRequestError`."""


# What a template's own code raises on data it does not expect (a number where it iterates,
# a format index past the arguments, a dict filter on a string, ...): Jinja passes these
# through unwrapped, beside its own `TemplateError`s.
_TEMPLATE_CODE_ERRORS = (TypeError, ValueError, LookupError, AttributeError, ArithmeticError,
                         RecursionError)


def _template_line(error: BaseException) -> int | None:
    """The template line an error was raised at (Jinja puts template frames, named
    "<template>", into the traceback)."""
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__)
             if f.filename == "<template>"]
    return lines[-1] if lines else None


def _check_messages(messages) -> None:
    """A list of dicts with a string 'role' and a 'content' that is a string, a list of
    content parts, or null / missing beside 'tool_calls' (an assistant calling tools)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of messages, got "
                                f"{type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"message {i} must be a dict with a 'role' and a 'content',"
                                    f" got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"message {i} needs a string 'role'" if "role" in m
                                    else f"message {i} has no 'role'")
        if "content" not in m and "tool_calls" not in m:
            raise ChatTemplateError(f"message {i} has no 'content'")
        content = m.get("content")
        if not isinstance(content, (str, list)) and not (content is None and "tool_calls" in m):
            raise ChatTemplateError(f"message {i} needs a string 'content' (or a list of "
                                    f"parts, or null beside 'tool_calls'), got "
                                    f"{type(content).__name__}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson`: plain `json.dumps` (Jinja's own escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _generation_tag():
    """transformers' `{% generation %}...{% endgeneration %}` block (it marks the assistant's
    tokens for training masks); the body renders as it is."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = frozenset({"generation"})

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


class ChatTemplate:
    """Renders messages with a Jinja chat template in the environment transformers gives
    one: sandboxed, trim_blocks and lstrip_blocks, loop controls (`break`, `continue`),
    `{% generation %}` blocks, `raise_exception`, `strftime_now` and transformers'
    `tojson`. `tools` (JSON schemas) and other keyword arguments reach the template as
    transformers passes them.

    A source that does not compile raises `ChatTemplateError` here; messages that are not a
    list of dicts with string 'role' and 'content', and any failure of the template on them
    (an undefined field used, a sandbox violation, a type error in a filter, the template's
    own `raise_exception`), raise it from `render_text` and `render`.
    """

    def __init__(self, source: str, tokenizer: Tokenizer):
        try:
            from jinja2 import TemplateSyntaxError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # pragma: no cover
            raise ImportError("chat templates need jinja2: pip install 'kvjax[hf]'") from e

        def raise_exception(message):
            raise ChatTemplateError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _generation_tag()])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: line {e.lineno}: "
                                    f"{e.message}") from None
        self.tokenizer = tokenizer

    def render_text(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    **kwargs) -> str:
        from jinja2 import TemplateError

        _check_messages(messages)
        try:
            return self.template.render(
                **{"tools": None, "documents": None, "bos_token": self.tokenizer.bos_token
                   or "", "eos_token": self.tokenizer.eos_token or "", **kwargs},
                messages=list(messages), add_generation_prompt=add_generation_prompt)
        except ChatTemplateError:
            raise
        except (TemplateError, *_TEMPLATE_CODE_ERRORS) as e:
            line = _template_line(e)
            where = f" at line {line}" if line is not None else ""
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}{where}: "
                                    f"{e}") from e

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True,
               **kwargs) -> list[int]:
        """The token ids the model sees (what the cache identity is made of)."""
        return self.tokenizer.encode(self.render_text(messages, add_generation_prompt,
                                                      **kwargs))


def load_tokenizer(path) -> tuple[Tokenizer, ChatTemplate | None]:
    """A folder with `tokenizer.json` (and optionally `tokenizer_config.json` with the bos/eos
    tokens), a GGUF file (its `tokenizer.ggml.*` vocabulary, see `kvjax.io.gguf`), or "byte"
    for the built-in byte tokenizer. The chat template comes from the folder's
    `chat_template.jinja` (where transformers 5 saves it), else from `tokenizer_config.json`
    (a string, or a list of named templates: the one named "default"), or from the GGUF
    file's `tokenizer.chat_template`.

    The tokenizer's `eos_ids` (where an `Engine` given it stops by default) are its EOS
    token's id and, for a folder, the `eos_token_id` (an id or a list) of its
    `generation_config.json`, else `config.json` (`kvjax.io.hf.eos_ids`, what transformers'
    `generate` stops at); for a GGUF file, its EOS, EOT and EOM ids (`tokenizer.ggml.*`)."""
    if str(path) == "byte":
        tok = ByteTokenizer()
        return tok, ChatTemplate(BYTE_CHAT_TEMPLATE, tok)
    path = Path(path)
    if path.suffix == ".gguf":
        from kvjax.io.gguf import gguf_metadata
        from kvjax.io.gguf_vocab import gguf_tokenizer

        backend, bos, eos, template = gguf_tokenizer(path)
        meta = gguf_metadata(path)
        keys = [f"tokenizer.ggml.{n}_token_id" for n in ("eos", "eot", "eom")]
        tok = HFTokenizer(backend, bos, eos, [int(meta[k]) for k in keys if k in meta])
        return tok, _template(template, tok, f"{path} (tokenizer.chat_template)")
    config = {}
    if (path / "tokenizer_config.json").exists():
        config = json.loads((path / "tokenizer_config.json").read_text())

    def token(name: str) -> str | None:
        value = config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    from kvjax.io.hf import eos_ids

    tok = HFTokenizer(path / "tokenizer.json", token("bos_token"), token("eos_token"),
                      eos_ids(path))
    if (path / "chat_template.jinja").exists():
        return tok, _template((path / "chat_template.jinja").read_text(), tok,
                              str(path / "chat_template.jinja"))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return tok, _template(template, tok, str(path / "tokenizer_config.json"))


def _template(source, tok: Tokenizer, where: str) -> ChatTemplate | None:
    """The chat template of `source` (None: there is none), errors naming `where`."""
    if not isinstance(source, str):
        return None
    try:
        return ChatTemplate(source, tok)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{where}: {e}") from None
