"""Shared fixtures for the engine tests: small tokenizers built in memory."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_CORPUS = [
    "Hello world, this is a small corpus for a tiny byte level BPE tokenizer. " * 3,
    "The quick brown fox jumps over the lazy dog. Stop here, stop there, stopping.",
    "你好，世界。日本語のテキスト。 Emoji: 😀 😀 🎉 and more text.",
]


@pytest.fixture(scope="session")
def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE (GPT-2 style): decode is the concatenation of the tokens' bytes.

    Its 396 tokens are the 256 bytes, ``<eos>`` (id 0), ``<pad>`` (id 1) and a few merges, so
    characters outside the corpus (e.g. 🦀, 漢) are split into several single-byte tokens.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    return tok


@pytest.fixture(scope="session")
def metaspace_tokenizer() -> Tokenizer:
    """SentencePiece-style word tokenizer: decode drops the first token's leading space."""
    vocab = {"<unk>": 0, "▁Hi": 1, "▁there": 2, "▁you": 3, "!": 4, "<s>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<s>"])
    return tok
