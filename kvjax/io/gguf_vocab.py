"""A GGUF file's vocabulary (`tokenizer.ggml.*`) as a `tokenizers.Tokenizer`.

Two kinds of vocabulary: byte-level BPE (`tokenizer.ggml.model` "gpt2": tokens and merges,
the split rules `tokenizer.ggml.pre` names) and SentencePiece BPE ("llama": tokens, scores
and token types; the merges follow from the scores: a pair merges in the order of the score
of the piece it makes, as SentencePiece's BPE does, unknown bytes fall back to `<0xNN>`
byte tokens).
"""

from __future__ import annotations

from kvjax.io.gguf import gguf_metadata
from kvjax.io.hf_families import CheckpointError

_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str | None):
    """The `tokenizers` pre-tokenizer of a byte-level vocabulary's `tokenizer.ggml.pre`."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "gpt2":
        return byte_level
    if pre == "smollm":  # digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    if pre in _LLAMA3_PRES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise CheckpointError(f"tokenizer.ggml.pre={pre!r}: this pre-tokenizer is not implemented "
                          f"(implemented: gpt2, smollm, llama-bpe; a file that names none "
                          f"leaves its split rules unknown)")


def gguf_tokenizer(path):
    """A GGUF file's vocabulary as a `tokenizers.Tokenizer`: byte-level BPE ("gpt2") or
    SentencePiece BPE ("llama"), control tokens (type 3) as special tokens matched whole,
    user-defined ones (type 4) as added tokens, and a post-processor adding BOS / EOS to a
    prompt where `tokenizer.ggml.add_bos_token` / `add_eos_token` say so. Returns
    (tokenizer, BOS token, EOS token, chat template source or None)."""
    from tokenizers import AddedToken, processors

    meta = gguf_metadata(path)
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise CheckpointError(f"tokenizer.ggml.model={model!r}: only byte-level BPE ('gpt2') "
                              f"and SentencePiece BPE ('llama') vocabularies are implemented")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", ()))
    tok = _byte_level(meta, tokens) if model == "gpt2" else _sentencepiece(meta, tokens, types)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types, strict=False) if kind == 3])
    # matched whole in the text before anything else, as SentencePiece matches its
    # user-defined symbols (Gemma's runs of spaces, tabs and newlines among them)
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types, strict=False) if kind == 4])

    def token(key: str) -> tuple[str, int] | None:  # (token, id)
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return (tokens[i], int(i)) if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos"), token("eos")  # (token, id) or None
    pre = [bos] if bos and meta.get("tokenizer.ggml.add_bos_token") else []
    post = [eos] if eos and meta.get("tokenizer.ggml.add_eos_token") else []
    if pre or post:  # what llama.cpp adds to a prompt
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join([t for t, _ in pre] + ["$A"] + [t for t, _ in post]),
            special_tokens=list(dict.fromkeys(pre + post)))
    return tok, bos and bos[0], eos and eos[0], meta.get("tokenizer.chat_template")


def _byte_level(meta: dict, tokens: list[str]):
    """Byte-level BPE: the file's merges, the split rules `tokenizer.ggml.pre` names."""
    from tokenizers import Tokenizer, decoders, models

    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
    pre = meta.get("tokenizer.ggml.pre")
    # Llama 3 (and llama.cpp for it) looks a whole word up before merging
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                               ignore_merges=pre in _LLAMA3_PRES))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict, tokens: list[str], types: list[int]):
    """SentencePiece BPE: spaces become "▁", then adjacent pieces merge while some pair
    makes a normal piece (type 1), the pair making the highest-scoring piece first (ties:
    the lower id); characters outside the vocabulary fall back to their `<0xNN>` bytes.
    A vocabulary that puts a "▁" before the text (`tokenizer.ggml.add_space_prefix`, Llama
    2's) is refused: llama.cpp adds it once, before the first piece of text only, which a
    normalizer (run on every piece between special tokens) cannot express."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    if meta.get("tokenizer.ggml.add_space_prefix", True):
        raise CheckpointError("tokenizer.ggml.add_space_prefix=True (or unset): a "
                              "SentencePiece vocabulary with a leading space is not "
                              "implemented (Gemma's sets it false)")
    scores = list(meta.get("tokenizer.ggml.scores", ()))
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise CheckpointError("a SentencePiece vocabulary needs tokenizer.ggml.scores and "
                              "token_type for every token")
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []  # (-score of the merged piece, its id, left id, right id)
    for i, piece in enumerate(tokens):
        if types[i] != 1:
            continue
        for k in range(1, len(piece)):
            left, right = vocab.get(piece[:k]), vocab.get(piece[k:])
            if left is not None and right is not None:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab, [(tokens[a], tokens[b]) for *_, a, b in ranked],
                               unk_token=tokens[unk] if unk is not None else None,
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    return tok
