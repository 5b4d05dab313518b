"""The vLLM connector's per-step figures (kvpushd_client.vllm.xfer_stats): which completion lands where."""

from __future__ import annotations

import pytest
from kvpushd_client import Completion, CompletionKind, TransferFigures
from kvpushd_client.vllm.xfer_stats import is_empty, new_data, record, record_lost

POSTED = TransferFigures(nbytes=8192, nixl_transfers=2, descriptors=6, post_s=0.001, transfer_s=0.004,
                         rendezvous_wait_s=0.002, elapsed_s=0.01)
NOT_POSTED = TransferFigures(nbytes=8192, elapsed_s=0.02)


def nonempty(d: dict[str, list[float | int]]) -> dict[str, list[float | int]]:
    return {k: v for k, v in d.items() if v}


def test_the_posting_side_records_the_nixl_figures() -> None:
    d = new_data()
    record(d, Completion(CompletionKind.FINISHED_SENDING, "t", figures=POSTED), sending=True)
    assert nonempty(d) == {"transfer_duration": [0.004], "post_duration": [0.001], "bytes_transferred": [8192],
                           "num_descriptors": [6], "rendezvous_wait": [0.002], "daemon_elapsed": [0.01]}


def test_the_other_side_records_its_elapsed_time_only() -> None:
    d = new_data()
    record(d, Completion(CompletionKind.FINISHED_RECEIVING, "t", figures=NOT_POSTED), sending=False)
    assert nonempty(d) == {"daemon_elapsed": [0.02]}
    d = new_data()  # pull: decode posted the READ (no rendezvous wait on that side)
    record(d, Completion(CompletionKind.FINISHED_RECEIVING, "t", figures=POSTED), sending=False)
    assert "rendezvous_wait" not in nonempty(d) and nonempty(d)["num_descriptors"] == [6]


@pytest.mark.parametrize(("code", "sending", "key"), [
    ("TRANSFER_ERROR", True, "num_failed_transfers"),
    ("LAYOUT_MISMATCH", False, "num_failed_transfers"),
    ("WORKER_GONE", False, "num_failed_transfers"),
    ("SHUTDOWN", True, "num_failed_transfers"),
    ("REFUSED", True, "num_failed_transfers"),
    ("PEER_UNREACHABLE", False, "num_failed_handshakes"),
    ("PEER_REJECTED", False, "num_failed_handshakes"),
    ("TIMEOUT", True, "num_kv_expired_reqs"),   # prefill: the publish lease expired (as NIXL: on P)
    ("TIMEOUT", False, "num_failed_transfers"),  # decode: the WRITEs never came
    ("ABORTED", False, None),
    ("SUPERSEDED", False, None),
])
def test_failures(code: str, sending: bool, key: str | None) -> None:
    d = new_data()
    record(d, Completion(CompletionKind.FAILED, "t", code, "why", (1, 2), figures=NOT_POSTED), sending=sending)
    assert nonempty(d) == ({key: [1]} if key else {})


def test_lost_daemon_and_emptiness() -> None:
    d = new_data()
    assert is_empty(d)
    record(d, Completion(CompletionKind.FINISHED_SENDING, "t"), sending=True)  # no figures: nothing
    assert is_empty(d)
    record_lost(d, 3)
    assert nonempty(d) == {"num_failed_transfers": [1, 1, 1]}
