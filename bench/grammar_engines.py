"""xgrammar against llguidance on this machine, on the jobs structured output gives a grammar
engine: compile a request's JSON schema, fill one token bitmask per decoded token, accept the
token, roll back (rejected speculative drafts). Teacher-forced: each engine walks the tokens
of the same valid output, so both do the same work; every token must be allowed by its mask.

The two libraries are not in pdserve's lock (the one chosen will be), so this runs as a
script in a venv of its own:

    python3 -m venv /tmp/grammar-venv
    /tmp/grammar-venv/bin/pip install torch==2.13.0
    /tmp/grammar-venv/bin/pip install xgrammar==0.2.9 llguidance==1.9.1 transformers==5.25.0
    /tmp/grammar-venv/bin/python -P bench/grammar_engines.py /tmp/peer-model/smollm2-hf

(``-P``: bench/ on the path would shadow the standard library's ``http``.)

Prints; never asserts a timing; exits 0 saying what is missing where a library is absent.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
from transformers import AutoTokenizer

SCHEMAS = {
    "flat object": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "ok": True}),
    "nested, arrays, enum": ({"type": "object", "properties": {
        "city": {"type": "string"},
        "days": {"type": "array", "items": {"type": "object", "properties": {
            "day": {"type": "string", "enum": ["mon", "tue", "wed"]},
            "temp": {"type": "number"}, "notes": {"type": "array", "items": {"type": "string"}}},
            "required": ["day", "temp", "notes"], "additionalProperties": False}}},
        "required": ["city", "days"], "additionalProperties": False},
        {"city": "Paris", "days": [{"day": "mon", "temp": 12.5, "notes": ["rain", "wind"]},
                                   {"day": "tue", "temp": 14.0, "notes": []}]}),
    "string patterns": ({"type": "object", "properties": {
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "code": {"type": "string", "minLength": 4, "maxLength": 8}},
        "required": ["email", "code"], "additionalProperties": False},
        {"email": "ada@example.com", "code": "x7y8z9"}),
}
# many optional properties: a schema whose grammar grows fast in some engines
WIDE = {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "null"]}
                                          for i in range(60)}, "additionalProperties": False}


def xgrammar_runs(tok, vocab_size):
    # lazy: neither library is in the lock; each engine's run imports its own
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - start

    def compile_schema(schema):
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                            separators=(",", ":"))

    def walk(compiled, token_ids):
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, vocab_size)
        fills = []
        for t in token_ids:
            s = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            fills.append(time.perf_counter() - s)
            allowed = bool((mask[0, t // 32] >> (t % 32)) & 1)
            assert allowed, f"xgrammar refused token {t}"
            assert matcher.accept_token(t)
        s = time.perf_counter()
        matcher.rollback(min(4, len(token_ids)))
        rollback = time.perf_counter() - s
        return fills, rollback
    return setup, compile_schema, walk


def llguidance_runs(tok, vocab_size):
    # lazy: neither library is in the lock; each engine's run imports its own
    import llguidance
    import llguidance.hf
    import llguidance.numpy as llnp

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
    setup = time.perf_counter() - start

    def compile_schema(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False,
                                          "item_separator": ",", "key_separator": ":"})
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def walk(grammar, token_ids):
        matcher = llguidance.LLMatcher(lltok, grammar)
        mask = llnp.allocate_token_bitmask(1, vocab_size)
        fills = []
        for t in token_ids:
            s = time.perf_counter()
            llnp.fill_next_token_bitmask(matcher, mask, 0)
            fills.append(time.perf_counter() - s)
            allowed = bool((mask[0, t // 32] >> (t % 32)) & 1)
            assert allowed, f"llguidance refused token {t}"
            assert matcher.consume_token(t), matcher.get_error()
        s = time.perf_counter()
        matcher.rollback(min(4, len(token_ids)))
        rollback = time.perf_counter() - s
        return fills, rollback
    return setup, compile_schema, walk


def main(model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = len(tok)
    print(f"tokenizer {model_dir}: {vocab_size} tokens")
    for name, runs in (("xgrammar", xgrammar_runs), ("llguidance", llguidance_runs)):
        setup, compile_schema, walk = runs(tok, vocab_size)
        print(f"\n{name}: tokenizer set-up {setup * 1e3:.0f} ms")
        for label, (schema, value) in SCHEMAS.items():
            text = json.dumps(value, separators=(",", ":"))
            token_ids = tok.encode(text, add_special_tokens=False)
            times = []
            for _ in range(5):
                s = time.perf_counter()
                compiled = compile_schema(schema)
                times.append(time.perf_counter() - s)
            fills_all = []
            for _ in range(5):
                fills, rollback = walk(compiled, token_ids)
                fills_all.extend(fills)
            fills_all = np.array(fills_all) * 1e6
            print(f"  {label:22s} compile median {statistics.median(times) * 1e3:7.2f} ms; "
                  f"mask fill per token median {np.median(fills_all):6.1f} us, "
                  f"p99 {np.percentile(fills_all, 99):7.1f} us ({len(token_ids)} tokens); "
                  f"rollback of 4 {rollback * 1e6:.1f} us")
        s = time.perf_counter()
        compile_schema(WIDE)
        print(f"  {'60 optional fields':22s} compile {(time.perf_counter() - s) * 1e3:7.2f} ms")


if __name__ == "__main__":
    try:
        import llguidance  # noqa: F401
        import xgrammar  # noqa: F401
    except ImportError as exc:
        print(f"{exc.name} is not installed here; see this script's docstring for its venv")
        sys.exit(0)
    if len(sys.argv) != 2:
        sys.exit("usage: grammar_engines.py MODEL_DIR (a Hugging Face folder with a tokenizer)")
    main(sys.argv[1])
