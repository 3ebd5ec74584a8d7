"""``python -m pdserve.bench.structured_peer``: without the peer it says so and exits; its rows
put each figure beside its ratio to vLLM's at the same concurrency; its schema takes what an
extraction answer looks like and refuses what it must not hold."""

from __future__ import annotations

import jsonschema
import pytest

from pdserve.bench import structured_peer


def test_without_the_peer_it_says_so(tmp_path, capsys):
    structured_peer.main(["--vllm", str(tmp_path / "no-vllm"), "--model", str(tmp_path)])
    assert "the peer is not installed here" in capsys.readouterr().out


def test_rows_carry_ratios_against_vllm():
    vllm = {"valid": 16, "sent": 16, "tok_s": 20.0, "ttft_ms": 400.0, "tpot_ms": 50.0,
            "errors": []}
    ours = {**vllm, "valid": 15, "tok_s": 25.0, "ttft_ms": 200.0, "errors": ["boom"]}
    rows = structured_peer.rows_of({("vllm", 8): vllm, ("pdserve-colocated", 8): ours}, 1)
    assert rows[0] == [1, "vllm", 8, "16/16", "20.0", "400", "50.0", ""]
    assert rows[1] == [1, "pdserve-colocated", 8, "15/16", "25.0 (1.25x)", "200 (0.50x)",
                       "50.0 (1.00x)", "boom"]


def test_the_schema():
    jsonschema.validate({"name": "hammer", "category": "tool", "price": 12.5,
                         "in_stock": True, "tags": ["red"]}, structured_peer.SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "hammer", "category": "weapon", "price": 1,
                             "in_stock": True, "tags": []}, structured_peer.SCHEMA)
