"""Header round trip, rejection of bad headers, checksum, pack/unpack of layer ranges."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer import (
    HEADER_WORDS,
    FrameHeader,
    FrameKind,
    FramingError,
    TransferKey,
    decode_header,
    encode_header,
    framing,
    layers_nbytes,
    pack_layers,
    payload_checksum,
    unpack_layers,
)

KEY = TransferKey(123456789012, 3)


def layers_header(**overrides) -> FrameHeader:
    fields = dict(kind=FrameKind.LAYERS, seq=5, key=KEY, layer_start=2, layer_end=4, arg=3,
                  payload_nbytes=3 * 2 * 512, payload_sum=-42)
    fields.update(overrides)
    return FrameHeader(**fields)


@pytest.mark.parametrize("header", [
    layers_header(),
    layers_header(payload_sum=None),
    FrameHeader(FrameKind.COMMIT, seq=9, key=TransferKey(2**63 - 1, 0), arg=31999, count=4),
    FrameHeader(FrameKind.COMMIT, seq=9, key=KEY, arg=5, count=4, num_stand_ins=11),
    FrameHeader(FrameKind.COMMIT, seq=9, key=KEY, arg=5, count=2, sharded=True,
                num_stand_ins=2**40),
    FrameHeader(FrameKind.ABORT, seq=1, key=KEY),
    FrameHeader(FrameKind.HEARTBEAT, seq=2, key=None),
    FrameHeader(FrameKind.CLOSE, seq=3, key=None),
])
def test_header_round_trip(header):
    tensor = encode_header(header)
    assert tensor.dtype == torch.int64 and tensor.shape == (HEADER_WORDS,)
    assert decode_header(tensor) == header


def _tamper(index: int, value: int, fix_sum: bool) -> torch.Tensor:
    tensor = encode_header(layers_header())
    tensor[index] = value
    if fix_sum:  # re-seal so the field check itself is exercised, not only the header sum
        tensor[13] = framing._header_sum(tensor[:13].tolist())
    return tensor


@pytest.mark.parametrize("index,value,match", [
    (0, 0x1234, "magic"),
    (1, 99, "version"),
    (2, 77, "kind"),
    (3, 0, "seq"),
    (4, -1, "negative"),
    (6, 5, "layer range"),
    (8, 0, "num_blocks"),
    (10, -8, "payload_nbytes"),
    (10, 1 << 40, "payload_nbytes"),
    (10, 3 * 2 * 512 + 1, "whole number"),
    (12, 8, "unknown flags"),
    (12, 2, "share and sharded are for COMMIT"),  # a LAYERS frame
    (9, (5 << 32) | 5, "bad K/V head range"),
])
def test_bad_fields_rejected(index, value, match):
    with pytest.raises(FramingError, match=match):
        decode_header(_tamper(index, value, fix_sum=True), max_payload_bytes=1 << 30)


def test_damaged_header_rejected_by_its_checksum():
    with pytest.raises(FramingError, match="checksum"):
        decode_header(_tamper(7, 5, fix_sum=False))


def test_wrong_size_or_dtype_rejected():
    good = encode_header(layers_header())
    with pytest.raises(FramingError):
        decode_header(good[:-1])
    with pytest.raises(FramingError):
        decode_header(good.to(torch.int32))


@pytest.mark.parametrize("header", [
    FrameHeader(FrameKind.COMMIT, seq=1, key=KEY, payload_nbytes=8),  # payload on COMMIT
    FrameHeader(FrameKind.HEARTBEAT, seq=1, key=KEY),  # key on HEARTBEAT
    FrameHeader(FrameKind.ABORT, seq=1, key=None),  # no key on ABORT
    FrameHeader(FrameKind.COMMIT, seq=1, key=KEY, arg=-1),  # negative token
    FrameHeader(FrameKind.COMMIT, seq=1, key=KEY, num_stand_ins=-1),
    FrameHeader(FrameKind.COMMIT, seq=1, key=KEY, count=1, share=True, num_stand_ins=1),
    FrameHeader(FrameKind.COMMIT, seq=1, key=KEY, layer_start=3),  # word 6 is num_stand_ins
    layers_header(num_stand_ins=1),
    FrameHeader(FrameKind.ABORT, seq=1, key=KEY, num_stand_ins=1),
])
def test_inconsistent_headers_cannot_be_encoded(header):
    with pytest.raises(FramingError):
        encode_header(header)


def test_commit_carries_num_stand_ins_in_word_6():
    """Word 6 is a LAYERS frame's layer_start and a COMMIT's num_stand_ins: each decodes as
    its own field, and a COMMIT's word 6 below 0 is refused by name."""
    commit = FrameHeader(FrameKind.COMMIT, seq=4, key=KEY, arg=17, count=3, num_stand_ins=6)
    words = encode_header(commit)
    assert int(words[6]) == 6
    decoded = decode_header(words)
    assert (decoded.num_stand_ins, decoded.layer_start) == (6, 0)
    assert decode_header(encode_header(layers_header())).num_stand_ins == 0
    words[6] = -3
    words[13] = framing._header_sum(words[:13].tolist())
    with pytest.raises(FramingError, match="num_stand_ins"):
        decode_header(words)


def test_transfer_key_validation():
    with pytest.raises(ValueError, match="epoch"):
        TransferKey(1, -1)
    with pytest.raises(ValueError, match="transfer_id"):
        TransferKey(2**63, 0)


def test_checksum_detects_one_byte_and_tail_changes():
    data = torch.randint(0, 256, (1003,), dtype=torch.uint8)  # 125 words + 3 tail bytes
    base = payload_checksum(data)
    assert payload_checksum(data.clone()) == base
    for pos in (0, 500, 1001):
        damaged = data.clone()
        damaged[pos] ^= 0x01
        assert payload_checksum(damaged) != base
    assert payload_checksum(data[1:]) != payload_checksum(data[:-1])  # unaligned view works


def test_pack_unpack_layer_range(kv):
    src, dst = kv.make_pool(1), kv.make_pool(2)
    before = kv.snapshot(dst)
    src_ids, dst_ids = torch.tensor([3, 0, 9]), torch.tensor([12, 5, 1])
    payload = pack_layers(src, src_ids, 1, 3)
    assert payload.shape[:3] == (2, 2, 3)
    assert payload.numel() * payload.element_size() == layers_nbytes(src, 3, 1, 3)
    flat = payload.reshape(-1).view(torch.uint8).clone()  # what a receiver holds
    unpack_layers(flat, dst, dst_ids, 1, 3)
    for layer in (1, 2):
        assert torch.equal(dst[layer].kv[:, dst_ids], src[layer].kv[:, src_ids])
    for layer in (0, 3):
        assert torch.equal(dst[layer].kv, before[layer])
    with pytest.raises(ValueError, match="payload"):
        unpack_layers(flat[:-4], dst, dst_ids, 1, 3)
    with pytest.raises(ValueError, match="layer_start"):
        pack_layers(src, src_ids, 3, 5)
