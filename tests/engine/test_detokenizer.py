"""Incremental detokenizer and stop strings: streamed deltas are exact, safe and cut right."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.step.detokenizer import (
    MAX_HELD_TOKENS,
    PROMPT_CONTEXT_TOKENS,
    REPLACEMENT_CHAR,
    Detokenizer,
    IncrementalDetokenizer,
    StopChecker,
)

TEXTS = [
    "Hello world, this is plain ASCII.",
    "你好，世界。漢字 and 日本語のテキスト",
    "Emoji 🦀🦀 crab, 😀 grin, 🎉! mixed 漢字🦀x",
    "🦀",
]


def stream(detok: Detokenizer, ids: list[int]) -> tuple[list[str], list]:
    deltas, pieces = [], []
    for token_id in ids:
        piece = detok.append(token_id)
        pieces.append(piece)
        deltas.append(piece.text)
        if piece.stopped:
            break
    return deltas, pieces


def test_fixture_splits_multibyte_characters(byte_tokenizer):
    ids = byte_tokenizer.encode("🦀漢").ids
    assert len(ids) >= 4
    assert any(REPLACEMENT_CHAR in byte_tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode_and_never_break_characters(byte_tokenizer, text):
    prompt = byte_tokenizer.encode("Hello 🦀").ids
    ids = byte_tokenizer.encode(text).ids
    detok = Detokenizer(byte_tokenizer, prompt)
    deltas, _ = stream(detok, ids)
    tail = detok.flush()
    assert "".join(deltas) + tail == byte_tokenizer.decode(ids) == text
    assert tail == ""
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert detok.output_text == text


def test_incomplete_character_is_held_then_released(byte_tokenizer):
    ids = byte_tokenizer.encode("🦀").ids
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    assert [detok.append(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.num_held_tokens == len(ids) - 1
    assert detok.append(ids[-1]) == "🦀"
    assert detok.num_held_tokens == 0


def test_flush_releases_an_unfinished_character(byte_tokenizer):
    ids = byte_tokenizer.encode("ab🦀").ids
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    emitted = "".join(detok.append(i) for i in ids[:-1])
    assert emitted == "ab"
    flushed = detok.flush()
    assert flushed and flushed.endswith(REPLACEMENT_CHAR)
    assert emitted + flushed == byte_tokenizer.decode(ids[:-1])
    assert detok.flush() == ""


def test_invalid_bytes_are_emitted_after_the_hold_limit(byte_tokenizer):
    # A lone UTF-8 lead byte repeated never completes: the text must not stall forever.
    lead = byte_tokenizer.encode("🦀").ids[0]
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    out = [detok.append(lead) for _ in range(MAX_HELD_TOKENS + 2)]
    assert out[: MAX_HELD_TOKENS - 1] == [""] * (MAX_HELD_TOKENS - 1)
    assert REPLACEMENT_CHAR in "".join(out)


def test_special_tokens_are_skipped_or_kept(byte_tokenizer):
    ids = byte_tokenizer.encode("Hi").ids + [0]  # <eos>
    skip = Detokenizer(byte_tokenizer, [])
    assert "".join(stream(skip, ids)[0]) + skip.flush() == "Hi"
    keep = Detokenizer(byte_tokenizer, [], skip_special_tokens=False)
    assert "".join(stream(keep, ids)[0]) + keep.flush() == "Hi<eos>"


def test_prompt_context_keeps_sentencepiece_spacing(metaspace_tokenizer):
    # decode([▁there]) alone is "there": the prompt's last token gives it its leading space.
    detok = Detokenizer(metaspace_tokenizer, [1])
    assert [detok.append(i).text for i in (2, 5, 3, 4)] == [" there", "", " you", "!"]
    assert detok.flush() == ""


def test_cost_per_token_is_a_small_window(byte_tokenizer):
    calls = []

    class Recording:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return byte_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    prompt = byte_tokenizer.encode("a long prompt " * 20).ids
    ids = byte_tokenizer.encode("some text 🦀 with 漢字 " * 20).ids
    detok = Detokenizer(Recording(), prompt)
    deltas, _ = stream(detok, ids)
    assert "".join(deltas) == byte_tokenizer.decode(ids)
    assert max(calls) <= PROMPT_CONTEXT_TOKENS + MAX_HELD_TOKENS + 1
    assert len(calls) <= 2 * len(ids) + 1


def test_stop_string_spanning_tokens_cuts_exactly(byte_tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    stop = "x jum"
    ids = byte_tokenizer.encode(text).ids
    assert stop not in [byte_tokenizer.decode([i]) for i in ids]
    detok = Detokenizer(byte_tokenizer, [], stop=[stop])
    deltas, pieces = stream(detok, ids)
    assert pieces[-1].stopped and pieces[-1].stop_reason == stop
    assert not any(p.stopped for p in pieces[:-1])
    assert "".join(deltas) == detok.output_text == "The quick brown fo"
    # stopped on the very token that completed the stop string
    assert stop in byte_tokenizer.decode(ids[: len(pieces)])
    assert stop not in byte_tokenizer.decode(ids[: len(pieces) - 1])
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.append(ids[len(pieces)])


def test_only_possible_stop_prefixes_are_held_back(byte_tokenizer):
    text, stop = "stop here, stopping.", "stopping"
    ids = byte_tokenizer.encode(text).ids
    detok = Detokenizer(byte_tokenizer, [], stop=[stop])
    emitted, held = "", []
    for i, token_id in enumerate(ids):
        piece = detok.append(token_id)
        emitted += piece.text
        assert "stop here, ".startswith(emitted)  # never a character of the stop string
        if piece.stopped:
            break
        held.append(byte_tokenizer.decode(ids[: i + 1])[len(emitted):])
        assert stop.startswith(held[-1])  # nothing else is held back
    assert emitted == "stop here, "
    assert "stop" in held  # the leading "stop" was held until " here" ruled it out


def test_prefix_overlap_stop():
    checker = StopChecker(["ab"])
    assert checker.check("a") == ("", None)
    assert checker.check("a") == ("a", None)
    assert checker.check("b") == ("", "ab")


def test_held_text_released_on_flush(byte_tokenizer):
    ids = byte_tokenizer.encode("Hello wor").ids
    detok = Detokenizer(byte_tokenizer, [], stop=["world", "xyz"])
    deltas, pieces = stream(detok, ids)
    assert not any(p.stopped for p in pieces)
    assert "".join(deltas) == "Hello "
    assert detok.flush() == "wor"
    assert detok.output_text == "Hello wor"
    assert detok.flush() == ""


def test_several_stop_strings_first_to_complete_wins(byte_tokenizer):
    ids = byte_tokenizer.encode("the lazy dog jumps").ids
    detok = Detokenizer(byte_tokenizer, [], stop=["dog jumps", "lazy", "zy d"])
    deltas, pieces = stream(detok, ids)
    assert pieces[-1].stop_reason == "lazy"
    assert "".join(deltas) == "the "


def test_stop_across_multibyte_characters(byte_tokenizer):
    ids = byte_tokenizer.encode("crab 🦀🦀 done").ids
    detok = Detokenizer(byte_tokenizer, [], stop=["🦀 d"])
    deltas, pieces = stream(detok, ids)
    assert pieces[-1].stopped
    assert "".join(deltas) == "crab 🦀"
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Generate char by char; stop at the first end position where a stop string appears."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            longest = max(hits, key=len)
            return text[: end - len(longest)], longest
    return text, None


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=14),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=14), max_size=6))
def test_stop_checker_matches_char_by_char_reference_for_any_chunking(text, stops, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    checker = StopChecker(stops)
    out, matched = "", None
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        safe, matched = checker.check(text[lo:hi])
        out += safe
        if matched is not None:
            break
    if matched is None:
        out += checker.release()
    expected_text, expected_stop = reference_stop(text, stops)
    assert out == expected_text
    if expected_stop is None:
        assert matched is None
    else:
        assert matched is not None and len(matched) == len(expected_stop)
        assert text[len(out):].startswith(matched)


class PythonDecoder:
    """The same tokenizer behind a plain ``decode``: the detokenizer's Python path."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream_both(tokenizer, prompt, ids, skip, flush_at):
    runs = []
    for decoder in (tokenizer, PythonDecoder(tokenizer)):
        detok = IncrementalDetokenizer(decoder, prompt, skip_special_tokens=skip)
        runs.append([detok.flush() if i in flush_at else detok.append(token_id)
                     for i, token_id in enumerate(ids)] + [detok.flush(), detok.num_held_tokens])
    return runs


@settings(max_examples=200, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_rust_stream_gives_the_python_path_deltas(byte_tokenizer, metaspace_tokenizer, data, skip):
    """Random ids (split characters, lone lead bytes past the hold limit, special tokens, ids
    past the vocabulary, flushes midway): the DecodeStream path emits what the Python path
    does, token for token."""
    tokenizer = data.draw(st.sampled_from([byte_tokenizer, metaspace_tokenizer]))
    vocab = tokenizer.get_vocab_size()
    emoji = byte_tokenizer.encode("🦀漢").ids if tokenizer is byte_tokenizer else [1, 2]
    token = st.one_of(st.integers(0, vocab + 2), st.sampled_from(emoji))
    prompt = data.draw(st.lists(token, max_size=8))
    ids = data.draw(st.lists(token, max_size=24))
    flush_at = data.draw(st.sets(st.integers(0, 23), max_size=2))
    assert IncrementalDetokenizer(tokenizer, [])._stream is not None  # the Rust path is used
    fast, slow = _stream_both(tokenizer, prompt, ids, skip, flush_at)
    assert fast == slow
