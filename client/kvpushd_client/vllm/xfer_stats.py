"""The worker's per-step transfer figures, as plain lists (no vLLM import): what ``stats.py``'s
``KVPushdKVConnectorStats`` carries from the workers to vLLM's stat loggers.

The keys and units are those of vLLM 0.33.0's ``NixlKVConnectorStats`` (seconds, bytes), so the
Prometheus series and the log line mean what they mean for ``NixlPushConnector``, plus two of
kvpushd's own. Every figure comes from the daemon (``Completion.figures``), none is measured here:

- ``transfer_duration``, ``post_duration``, ``bytes_transferred``, ``num_descriptors``: one entry per
  finished transfer on the engine whose daemon posted the NIXL transfers (prefill in push mode, its
  WRITEs; decode in pull mode, its READs), as NixlPushConnector records them on the side that posts.
  A transfer of several WRITEs (TP pairs) is one entry: bytes and descriptors summed, post time
  summed, transfer time the longest.
- ``num_failed_transfers``: FAILED completions (TRANSFER_ERROR, LAYOUT_MISMATCH, WORKER_GONE,
  SHUTDOWN, REFUSED, a decode TIMEOUT) and transfers lost with the daemon; ``num_failed_handshakes``:
  PEER_UNREACHABLE and PEER_REJECTED; ``num_kv_expired_reqs``: a prefill-side TIMEOUT (published
  blocks whose lease expired, as in NIXL: tracked on P). ABORTED and SUPERSEDED are not failures.
  ``num_failed_notifications`` and ``num_notifications_after_expiry`` stay empty: the daemon holds
  notifications and never hands the engine one after its request ended.
- ``rendezvous_wait`` (kvpushd): prefill, push: first of publish/registration -> the second.
- ``daemon_elapsed`` (kvpushd): both sides, every finished transfer: its Publish/Expect -> completion
  in the daemon.
"""

from __future__ import annotations

from ..types import Completion, CompletionKind

Data = dict[str, list[float | int]]

KEYS = ("transfer_duration", "post_duration", "bytes_transferred", "num_descriptors", "num_failed_transfers",
        "num_failed_notifications", "num_failed_handshakes", "num_kv_expired_reqs", "num_notifications_after_expiry",
        "rendezvous_wait", "daemon_elapsed")

_NOT_FAILURES = frozenset({"ABORTED", "SUPERSEDED"})
_HANDSHAKE = frozenset({"PEER_UNREACHABLE", "PEER_REJECTED"})


def new_data() -> Data:
    return {k: [] for k in KEYS}


def is_empty(data: Data) -> bool:
    return not any(data.values())


def record(data: Data, c: Completion, sending: bool) -> None:
    """One completion of this worker (``sending``: a Publish's, else an Expect's)."""
    if c.kind is CompletionKind.FAILED:
        if c.code in _NOT_FAILURES:
            return
        if c.code in _HANDSHAKE:
            data["num_failed_handshakes"].append(1)
        elif c.code == "TIMEOUT" and sending:
            data["num_kv_expired_reqs"].append(1)
        else:
            data["num_failed_transfers"].append(1)
        return
    f = c.figures
    if f is None:
        return
    data["daemon_elapsed"].append(f.elapsed_s)
    if f.nixl_transfers:
        data["transfer_duration"].append(f.transfer_s)
        data["post_duration"].append(f.post_s)
        data["bytes_transferred"].append(f.nbytes)
        data["num_descriptors"].append(f.descriptors)
        if sending:
            data["rendezvous_wait"].append(f.rendezvous_wait_s)


def record_lost(data: Data, n: int) -> None:
    """``n`` transfers failed because the daemon went away."""
    data["num_failed_transfers"].extend([1] * n)
