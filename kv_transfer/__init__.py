"""pdserve.kv_transfer: moving a request's KV blocks from a prefill worker to a decode worker.

The protocol in call order is in :mod:`pdserve.kv_transfer.base`; the real transport (a 2-rank
torch.distributed group per pair) in :mod:`~pdserve.kv_transfer.torch_dist`; an in-process one
with fault injection in :mod:`~pdserve.kv_transfer.inproc`.
"""

from pdserve.kv_transfer.base import (
    ChannelConfig,
    FrameKind,
    FramingError,
    KVConnector,
    KVReceiver,
    KVReceiveSink,
    KVSender,
    TransferError,
    TransferKey,
)
from pdserve.kv_transfer.bench import measure_channel, measure_memcpy, measure_transfer
from pdserve.kv_transfer.framing import (
    HEADER_WORDS,
    FrameHeader,
    decode_header,
    encode_header,
    layers_nbytes,
    pack_layers,
    payload_checksum,
    unpack_layers,
)
from pdserve.kv_transfer.inproc import (
    FaultKind,
    FaultPlan,
    InProcConnector,
    InProcEndpoint,
    InProcHub,
)
from pdserve.kv_transfer.receiver import PeerDispatcher, PeerStats
from pdserve.kv_transfer.sink import ReservedBlocksSink
from pdserve.kv_transfer.torch_dist import (
    TorchDistConnector,
    TorchDistSender,
    TransferEndpoint,
)

__all__ = [
    "HEADER_WORDS", "ChannelConfig", "FaultKind", "FaultPlan", "FrameHeader", "FrameKind",
    "FramingError", "InProcConnector", "InProcEndpoint", "InProcHub", "KVConnector",
    "KVReceiveSink", "KVReceiver", "KVSender", "PeerDispatcher", "PeerStats",
    "ReservedBlocksSink", "TorchDistConnector", "TorchDistSender", "TransferEndpoint",
    "TransferError", "TransferKey", "decode_header", "encode_header", "layers_nbytes",
    "measure_channel", "measure_memcpy", "measure_transfer", "pack_layers", "payload_checksum",
    "unpack_layers",
]
