"""How a peer call or stream that ended maps to the errors its items fail with (no network)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvpushd.config import PeerApiConfig
from kvpushd.core.errors import PeerRejected, PeerUnreachable
from kvpushd.core.peerlink import LinkState
from kvpushd.runtime.identity import Identity
from kvpushd.runtime.outbound import PeerClient


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(("code", "kind"), [
    (grpc.StatusCode.UNAVAILABLE, PeerUnreachable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, PeerUnreachable),
    # a stream the peer's server cancelled (it stopped, or restarted mid-batch): nobody refused the
    # items, so they are unreachable (the decode side may decline them later), not rejected
    (grpc.StatusCode.CANCELLED, PeerUnreachable),
    (grpc.StatusCode.PERMISSION_DENIED, PeerRejected),
    (grpc.StatusCode.INVALID_ARGUMENT, PeerRejected),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, PeerRejected),
])
def test_stream_end_maps_to_item_error(code: grpc.StatusCode, kind: type) -> None:
    async def run() -> None:
        peer = PeerClient("127.0.0.1:1", Identity("n", "127.0.0.1:2"), PeerApiConfig(), lambda a, w: None)
        try:
            peer.link.state = LinkState.CONNECTED
            err = peer._stream_broken(_rpc_error(code, code.name))
            assert type(err) is kind, err
            assert code.name in str(err)
            assert peer.link.state is LinkState.UNREACHABLE  # a broken stream: the next item handshakes first
            assert type(peer._error(_rpc_error(code, "x"))) is kind
        finally:
            await peer.channel.close()

    asyncio.run(run())
