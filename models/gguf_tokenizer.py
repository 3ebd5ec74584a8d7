"""A :class:`~pdserve.models.tokenizer.Tokenizer` built from a GGUF file's metadata.

A GGUF has no ``tokenizer.json``: the vocabulary (``tokenizer.ggml.tokens``, in id order), the
token types, the merges (or scores) and the special ids are metadata. They are rebuilt here with
the ``tokenizers`` library into the pipeline transformers' GGUF loading builds, so ids and text
match it:

* ``tokenizer.ggml.model = "gpt2"`` (Llama 3, Qwen, SmolLM): byte-level BPE. The split regex
  comes from ``tokenizer.ggml.pre`` (llama-bpe / llama3 / smaug-bpe, qwen2, tekken, gpt-4o ...,
  the same table transformers and llama.cpp keep); unknown ``pre`` values use GPT-2's.
* ``tokenizer.ggml.model = "llama"`` (Llama 2, Mistral): sentencepiece-style BPE with byte
  fallback (``<0x41>`` tokens), a ``▁`` metaspace prepended to the text (unless
  ``tokenizer.ggml.add_space_prefix`` is false, as llama.cpp reads it) and merges from the file
  or, when it has none, recovered from the vocabulary and its scores.

Token type 3 (control: ``<s>``, ``<|im_end|>``) become special added tokens, skipped when
decoding; type 4 (user-defined: ``<think>``) plain added tokens, always matched whole. BOS is
prepended when ``tokenizer.ggml.add_bos_token`` says so (default: yes for "llama", no for
"gpt2"), EOS appended with ``add_eos_token``. ``tokenizer.chat_template`` is kept on the
tokenizer as ``chat_template``.
"""

from __future__ import annotations

import functools
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from pdserve.models.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regex its merges were learned with
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges a sentencepiece vocabulary implies: every split of a token into two tokens,
    best score first (transformers' ``generate_merges``, so both give the same merges)."""
    merges = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _file_merges(md: dict[str, Any]) -> list[tuple[str, str]] | None:
    merges = md.get("tokenizer.ggml.merges")
    if merges is None:
        return None
    return [tuple(m.split(" ", 1)) for m in merges]


def _byte_level(md: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # a token spelled outside the byte alphabet (rare, e.g. a raw special) is respelled
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = _file_merges(md)
    if merges is None:
        merges = merges_from_scores(vocab, {t: -i for t, i in vocab.items()})
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                          continuing_subword_prefix="", end_of_word_suffix="",
                                          fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(md.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(md: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _file_merges(md)
    if merges is None:
        scores = md.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
        merges = merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True,
                                          byte_fallback=True, dropout=None))
    prefix = md.get("tokenizer.ggml.add_space_prefix", True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


_BUILDERS = {"gpt2": _byte_level, "llama": _sentencepiece}


def _post_processor(tokens: list[str], bos: int | None, eos: int | None, add_bos: bool,
                    add_eos: bool):
    single, specials = "$A", []
    if add_bos and bos is not None:
        single = f"{tokens[bos]} {single}"
        specials.append((tokens[bos], bos))
    if add_eos and eos is not None:
        single = f"{single} {tokens[eos]}"
        specials.append((tokens[eos], eos))
    if not specials:
        return None
    return processors.TemplateProcessing(single=single,
                                         special_tokens=list(dict.fromkeys(specials)))


def tokenizer_from_metadata(md: dict[str, Any], eos_token_ids: tuple[int, ...] = (),
                            source: str = "the GGUF file") -> Tokenizer:
    """The tokenizer a GGUF's metadata describes (see the module docstring)."""
    kind = md.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in md:
        raise FileNotFoundError(f"{source} has no tokenizer (tokenizer.ggml.model / tokens)")
    if kind not in _BUILDERS:
        raise ValueError(f"tokenizer.ggml.model {kind!r} in {source} is not supported; "
                         f"supported: {', '.join(_BUILDERS)}")
    tokens = list(md["tokenizer.ggml.tokens"])
    types = list(md.get("tokenizer.ggml.token_type") or [])
    tok = _BUILDERS[kind](md, tokens)
    byte_alphabet = set(bytes_to_unicode().values()) if kind == "gpt2" else None
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind_id in zip(tokens, types, strict=False)
               if kind_id == CONTROL and (byte_alphabet is None or set(t) <= byte_alphabet)]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind_id in zip(tokens, types, strict=False) if kind_id == USER_DEFINED]
    if user:
        tok.add_tokens(user)
    bos = md.get("tokenizer.ggml.bos_token_id")
    eos = md.get("tokenizer.ggml.eos_token_id")
    add_bos = md.get("tokenizer.ggml.add_bos_token", kind == "llama")
    post = _post_processor(tokens, bos, eos, bool(add_bos), bool(md.get(
        "tokenizer.ggml.add_eos_token", False)))
    if post is not None:
        tok.post_processor = post
    return Tokenizer(tok, eos_token_ids=eos_token_ids or ((eos,) if eos is not None else ()),
                     bos_token_id=bos, add_bos_token=None,
                     chat_template=md.get("tokenizer.chat_template"))
