"""Wire framing: a fixed int64 header tensor, then (LAYERS only) a raw uint8 payload.

Header, ``HEADER_WORDS`` int64 values::

    0 magic            MAGIC
    1 version          VERSION
    2 kind             FrameKind
    3 seq              per-channel frame number, 1, 2, ... (duplicates and gaps show up here)
    4 transfer_id      TransferKey.transfer_id (0 for HEARTBEAT / CLOSE)
    5 epoch            TransferKey.epoch (0 for HEARTBEAT / CLOSE)
    6 layer_start      LAYERS: first layer of the range; COMMIT: num_stand_ins, the
                       number of leading blocks of the shipment (the blocks after the
                       reservation's cached ones) that hold no KV: the sender had freed them
                       (out of its sliding window) and sent stand-ins so the blocks map one to
                       one onto the reservation's; the receiver frees them and never hashes them
    7 layer_end        LAYERS: one past the last layer
    8 arg              LAYERS: num_blocks; COMMIT: first_token_id
    9 count            COMMIT: number of LAYERS frames sent for the key on this channel;
                       LAYERS: the K/V heads carried, first << 32 | one past the last, in the
                       full model's numbering (0: every head of the sender's pool, which is the
                       receiver's)
    10 payload_nbytes  LAYERS: bytes that follow; 0 otherwise
    11 payload_sum     wrapping int64 sum of the payload's int64 words (+ tail bytes)
    12 flags           FLAG_CHECKSUM when payload_sum is meaningful; COMMIT: FLAG_SHARE (this
                       channel's share of a transfer whose commit travels on another channel:
                       no token, completes nothing by itself), FLAG_SHARDED (the transfer's
                       commit, while shares of its heads may still be on other channels)
    13 header_sum      mix of words 0..12, so a damaged header is rejected, not misread

Head-sliced frames are how tensor parallel groups exchange KV rank to rank
(docs/tensor-parallel.md): a sender rank ships the heads it holds that a receiver rank holds,
and the receiver completes a key once every head of every layer it holds has arrived.

The payload of a LAYERS frame is :func:`pack_layers` of the request's blocks viewed as bytes:
(num_layers, 2, num_blocks, block_size, kv_heads, head_dim) in the cache dtype, followed, for
int8 layers with dynamic per-token scales, by those scales (num_layers, num_dynamic_halves,
num_blocks, block_size, kv_heads) float16, so the scales travel with their blocks. No pickle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import KVCacheLayer, pack_blocks, unpack_blocks
from pdserve.kernels.kv_layout import TOKEN_SCALE_DTYPE
from pdserve.kernels.torch_ops import pack_token_scales, unpack_token_scales
from pdserve.kv_transfer.base import FrameKind, FramingError, TransferKey

MAGIC = 0x5044_4B56_4652_4D31  # "PDKVFRM1"
VERSION = 1
HEADER_WORDS = 14  # never change: receivers post a recv of exactly this size before reading it
FLAG_CHECKSUM = 1
FLAG_SHARE = 2
FLAG_SHARDED = 4
_FLAGS = FLAG_CHECKSUM | FLAG_SHARE | FLAG_SHARDED
MAX_HEADS = 1 << 31
MAX_LAYERS = 1 << 16
_MASK = (1 << 64) - 1
_KEYED = (FrameKind.LAYERS, FrameKind.COMMIT, FrameKind.ABORT)


@dataclass(frozen=True)
class FrameHeader:
    """A decoded header (see the module docstring for the wire layout)."""

    kind: FrameKind  # what the frame carries
    seq: int  # per-channel frame number, from 1
    key: TransferKey | None  # the transfer; None for HEARTBEAT / CLOSE
    layer_start: int = 0  # LAYERS: first layer
    layer_end: int = 0  # LAYERS: one past the last layer
    arg: int = 0  # LAYERS: num_blocks; COMMIT: first_token_id
    count: int = 0  # COMMIT: LAYERS frames sent for the key
    payload_nbytes: int = 0  # bytes following the header
    payload_sum: int | None = None  # payload checksum, None when the sender skipped it
    heads: tuple[int, int] | None = None  # LAYERS: K/V heads [first, end) carried (global
    # numbering); None: every head of the pool
    share: bool = False  # COMMIT: one channel's share of a transfer (FLAG_SHARE)
    sharded: bool = False  # COMMIT: the transfer's commit; shares may be elsewhere
    num_stand_ins: int = 0  # COMMIT: leading shipped blocks that hold no KV (word 6, which
    # LAYERS use for layer_start; a COMMIT has no layer range)


def _to_signed(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def _header_sum(words: list[int]) -> int:
    acc = 0x9E37_79B9_7F4A_7C15
    for i, word in enumerate(words):
        acc = ((acc ^ (word & _MASK)) * (0x100_0000_01B3 + 2 * i)) & _MASK
    return _to_signed(acc)


def encode_header(header: FrameHeader) -> torch.Tensor:
    """The int64 CPU tensor of ``HEADER_WORDS`` for ``header`` (validated first)."""
    _validate(header, max_payload_bytes=1 << 62)
    key = header.key
    count = header.count
    if header.kind == FrameKind.LAYERS:
        count = 0 if header.heads is None else header.heads[0] << 32 | header.heads[1]
    flags = ((FLAG_CHECKSUM if header.payload_sum is not None else 0)
             | (FLAG_SHARE if header.share else 0) | (FLAG_SHARDED if header.sharded else 0))
    words = [
        MAGIC, VERSION, int(header.kind), header.seq,
        key.transfer_id if key else 0, key.epoch if key else 0,
        header.num_stand_ins if header.kind == FrameKind.COMMIT else header.layer_start,
        header.layer_end, header.arg, count, header.payload_nbytes,
        header.payload_sum if header.payload_sum is not None else 0, flags,
    ]
    words.append(_header_sum(words))
    return torch.tensor([_to_signed(w) for w in words], dtype=torch.int64)


def decode_header(tensor: torch.Tensor, max_payload_bytes: int = 1 << 34) -> FrameHeader:
    """Parse and validate a received header tensor; raises FramingError on anything odd."""
    if tensor.dtype != torch.int64 or tensor.numel() != HEADER_WORDS:
        raise FramingError(f"header must be {HEADER_WORDS} int64 values, "
                           f"got {tensor.numel()} {tensor.dtype}")
    words = tensor.cpu().tolist()
    if words[0] != _to_signed(MAGIC):
        raise FramingError(f"bad magic {words[0]:#x}")
    if words[1] != VERSION:
        raise FramingError(f"unsupported version {words[1]}")
    if words[13] != _header_sum(words[:13]):
        raise FramingError("header checksum mismatch")
    try:
        kind = FrameKind(words[2])
    except ValueError:
        raise FramingError(f"unknown frame kind {words[2]}") from None
    if words[12] & ~_FLAGS:
        raise FramingError(f"unknown flags {words[12]:#x}")
    if kind in _KEYED:
        if words[4] < 0 or words[5] < 0:
            raise FramingError(f"negative transfer_id/epoch {words[4]}/{words[5]}")
        key = TransferKey(words[4], words[5])
    else:
        key = None
    count, heads = words[9], None
    if kind == FrameKind.LAYERS:
        count, heads = 0, (None if words[9] == 0 else (words[9] >> 32, words[9] & 0xFFFF_FFFF))
    layer_start, num_stand_ins = words[6], 0
    if kind == FrameKind.COMMIT:
        layer_start, num_stand_ins = 0, words[6]
    header = FrameHeader(kind=kind, seq=words[3], key=key, layer_start=layer_start,
                         layer_end=words[7], arg=words[8], count=count,
                         payload_nbytes=words[10],
                         payload_sum=words[11] if words[12] & FLAG_CHECKSUM else None,
                         heads=heads, share=bool(words[12] & FLAG_SHARE),
                         sharded=bool(words[12] & FLAG_SHARDED), num_stand_ins=num_stand_ins)
    _validate(header, max_payload_bytes)
    return header


def _validate(h: FrameHeader, max_payload_bytes: int) -> None:
    if h.seq < 1:
        raise FramingError(f"seq must be >= 1, got {h.seq}")
    if (h.key is None) == (h.kind in _KEYED):
        raise FramingError(f"{h.kind.name} frame {'needs' if h.key is None else 'takes no'} key")
    if h.kind == FrameKind.LAYERS:
        if not 0 <= h.layer_start < h.layer_end <= MAX_LAYERS:
            raise FramingError(f"bad layer range [{h.layer_start}, {h.layer_end})")
        if h.arg <= 0:
            raise FramingError(f"LAYERS frame needs num_blocks > 0, got {h.arg}")
        if not 0 < h.payload_nbytes <= max_payload_bytes:
            raise FramingError(f"payload_nbytes {h.payload_nbytes} outside "
                               f"(0, {max_payload_bytes}]")
        if h.payload_nbytes % (h.arg * (h.layer_end - h.layer_start)) != 0:
            raise FramingError(f"payload_nbytes {h.payload_nbytes} is not a whole number of "
                               f"blocks ({h.arg}) x layers ({h.layer_end - h.layer_start})")
        if h.heads is not None and not 0 <= h.heads[0] < h.heads[1] < MAX_HEADS:
            raise FramingError(f"bad K/V head range {h.heads}")
    elif h.payload_nbytes != 0 or h.payload_sum is not None:
        raise FramingError(f"{h.kind.name} frame carries no payload, got {h.payload_nbytes} B")
    if h.kind == FrameKind.COMMIT and (h.count < 0 or h.arg < 0):
        raise FramingError(f"COMMIT needs count >= 0 and first_token_id >= 0, "
                           f"got {h.count}, {h.arg}")
    _validate_stand_ins(h)
    if h.kind != FrameKind.LAYERS and h.heads is not None:
        raise FramingError(f"{h.kind.name} frame carries no head range")
    if (h.share or h.sharded) and (h.kind != FrameKind.COMMIT or (h.share and h.sharded)):
        raise FramingError("share and sharded are for COMMIT frames, one at a time")


def _validate_stand_ins(h: FrameHeader) -> None:
    """``num_stand_ins`` rides in word 6 of a transfer's COMMIT only (whether it is below
    the blocks expected is the receiver's check: the header does not know them)."""
    if h.num_stand_ins < 0:
        raise FramingError(f"num_stand_ins must be >= 0, got {h.num_stand_ins}")
    if h.num_stand_ins and (h.kind != FrameKind.COMMIT or h.share):
        raise FramingError("num_stand_ins is for a transfer's COMMIT frame, not "
                           f"{'a share' if h.share else h.kind.name}")
    if h.kind == FrameKind.COMMIT and (h.layer_start or h.layer_end):
        raise FramingError(f"COMMIT carries no layer range, got [{h.layer_start}, "
                           f"{h.layer_end})")


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("payload must be contiguous")
    return tensor.reshape(-1).view(torch.uint8)  # (nbytes,)


def payload_checksum(data: torch.Tensor) -> int:
    """Wrapping int64 sum of a uint8 tensor's 8-byte words plus its tail bytes (on its device).

    One pass at memory speed; any single damaged byte changes it."""
    flat = as_bytes(data)
    nwords = flat.numel() // 8
    head = flat[: nwords * 8]
    if head.numel() and head.storage_offset() % 8:
        head = head.clone()  # view(int64) needs 8-byte alignment
    total = int(head.view(torch.int64).sum().item()) if nwords else 0
    tail = flat[nwords * 8:]
    if tail.numel():
        total += int(tail.to(torch.int64).sum().item()) * 0x1_0000_0001
    return _to_signed(total)


def layers_nbytes(caches: list[KVCacheLayer], num_blocks: int, layer_start: int,
                  layer_end: int, heads: tuple[int, int] | None = None) -> int:
    """Payload bytes of ``num_blocks`` blocks over layers ``[layer_start, layer_end)``;
    ``heads``: only the pool's K/V heads ``[first, end)`` (its own numbering)."""
    nbytes = sum(c.bytes_per_block for c in caches[layer_start:layer_end]) * num_blocks
    if heads is None:
        return nbytes
    return nbytes * (heads[1] - heads[0]) // caches[0].kv.shape[3]


def _check_heads(layers: list[KVCacheLayer], heads: tuple[int, int]) -> None:
    if not 0 <= heads[0] < heads[1] <= layers[0].kv.shape[3]:
        raise ValueError(f"K/V heads {heads} outside the pool's {layers[0].kv.shape[3]}")
    if _token_scaled(layers):
        raise ValueError("head-sliced frames of int8 layers with token scales are not built")


def _check_range(caches: list[KVCacheLayer], layer_start: int, layer_end: int) -> None:
    if not 0 <= layer_start < layer_end <= len(caches):
        raise ValueError(f"layer range [{layer_start}, {layer_end}) outside "
                         f"[0, {len(caches)}) (layer_start, layer_end)")


def pack_layers(caches: list[KVCacheLayer], block_ids: torch.Tensor, layer_start: int,
                layer_end: int, backend: str = "auto",
                heads: tuple[int, int] | None = None) -> torch.Tensor:
    """Gather ``block_ids`` of layers ``[layer_start, layer_end)`` into one contiguous payload
    (num_layers, 2, num_blocks, block_size, kv_heads, head_dim), what ``send_layers`` takes.

    ``block_ids`` is an int64 tensor on the caches' device. Layers in the range must share
    shape and dtype (they do in one pool). With dynamic token scales the payload is flat uint8
    (blocks, then scales: see the module docstring); send it with ``num_blocks``.
    ``heads``: only the pool's K/V heads ``[first, end)`` (its own numbering), a
    (num_layers, 2, num_blocks, block_size, end - first, head_dim) payload."""
    _check_range(caches, layer_start, layer_end)
    layers = caches[layer_start:layer_end]
    if heads is not None:
        _check_heads(layers, heads)
        return torch.stack([c.kv.index_select(1, block_ids)[:, :, :, heads[0]:heads[1]]
                            for c in layers])
    packed = pack_blocks(layers, block_ids, backend=backend)
    if not _token_scaled(layers):
        return packed.contiguous()
    scales = pack_token_scales(layers, block_ids)
    return torch.cat([as_bytes(packed.contiguous()), as_bytes(scales.contiguous())])


def _token_scaled(layers: list[KVCacheLayer]) -> bool:
    """Whether the layers carry token scales (all alike, as frames group layers by kind)."""
    kinds = {(c.k_token_scale is not None, c.v_token_scale is not None) for c in layers}
    if len(kinds) != 1:
        raise ValueError("layers in one frame must all have, or all lack, the same token scales")
    return any(kinds.pop())


def unpack_layers(payload: torch.Tensor, caches: list[KVCacheLayer], block_ids: torch.Tensor,
                  layer_start: int, layer_end: int, backend: str = "auto",
                  heads: tuple[int, int] | None = None) -> None:
    """Scatter a :func:`pack_layers` payload (any shape or dtype with the right bytes, e.g. the
    flat uint8 buffer a receiver filled) into ``block_ids`` of the given layers (``heads``:
    into those K/V heads of the pool only)."""
    _check_range(caches, layer_start, layer_end)
    first = caches[layer_start].kv
    expected = layers_nbytes(caches, block_ids.numel(), layer_start, layer_end, heads)
    if payload.numel() * payload.element_size() != expected:
        raise ValueError(f"payload has {payload.numel() * payload.element_size()} bytes, "
                         f"expected {expected} (payload)")
    layers = caches[layer_start:layer_end]
    flat = as_bytes(payload)
    if heads is not None:
        _check_heads(layers, heads)
        # (nbytes,) -> (num_layers, 2, num_blocks, block_size, heads, head_dim)
        shaped = flat.view(first.dtype).view(layer_end - layer_start, 2, block_ids.numel(),
                                             first.shape[2], heads[1] - heads[0],
                                             first.shape[4])
        for layer, cache in enumerate(layers):
            cache.kv[:, block_ids, :, heads[0]:heads[1]] = shaped[layer]
        return
    kv_nbytes = len(layers) * 2 * block_ids.numel() * first[0, 0].numel() * first.element_size()
    # (nbytes,) -> (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
    shaped = flat[:kv_nbytes].view(first.dtype).view(
        layer_end - layer_start, 2, block_ids.numel(), *first.shape[2:])
    unpack_blocks(shaped, layers, block_ids, backend=backend)
    if _token_scaled(layers):  # (num_layers, halves, num_blocks, block_size, kv_heads)
        scales = flat[kv_nbytes:].view(TOKEN_SCALE_DTYPE).view(
            len(layers), len(layers[0].token_scales), block_ids.numel(), *first.shape[2:4])
        unpack_token_scales(scales, layers, block_ids)
