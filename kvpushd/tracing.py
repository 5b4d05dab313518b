"""Transfer tracing: the hooks the runtime calls, and a no-op default.

Off (no ``[tracing] otlp_endpoint``) the runtime holds a ``Tracing`` whose ``enabled`` is False and
checks that flag before each hook, so a transfer pays one attribute read per hook and opentelemetry
is never imported. On, ``telemetry.make_tracing`` loads ``kvpushd.otel`` (the only module that imports
opentelemetry), which exports spans over OTLP/gRPC.

Spans per transfer (all in the trace of the engine request's W3C ``traceparent`` when one came):

- decode daemon: ``kvpushd.recv`` (Expect -> completion), children ``kvpushd.register`` (the
  Register call to the prefill daemon), ``kvpushd.wait_notifications`` (registered -> every producer
  rank's notification landed; push) or ``kvpushd.nixl_read`` (pull). Its context rides in Register.
- prefill daemon: ``kvpushd.send`` (first of Publish/Register -> completion; parent: the decode daemon's
  ``kvpushd.recv`` from Register, else the Publish's traceparent, which is then a link), children
  ``kvpushd.rendezvous_wait`` (first of publish/registration -> the second) and ``kvpushd.nixl_write``
  (queued -> posted -> done, with bytes and descriptors) per WRITE.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .core.types import Completion

if TYPE_CHECKING:
    from .transfer.records import ReadResult, WriteResult


class Tracing:
    """No tracing: every hook does nothing (the runtime skips them while ``enabled`` is False)."""

    enabled = False

    # decode side
    def expect(self, worker_id: str, transfer_id: str, traceparent: str, engine_id: str, peer: str) -> None:
        """An Expect was taken: its span starts now."""

    def register_context(self, worker_id: str, transfer_id: str) -> str:
        """The traceparent to send in Register (the decode span's context); "" when none."""
        return ""

    def registered(self, worker_id: str, transfer_id: str, started_ns: int, error: str = "") -> None:
        """The Register call that started at ``started_ns`` (time.time_ns) was answered (or failed)."""

    # prefill side
    def publish(self, worker_id: str, transfer_id: str, traceparent: str, engine_id: str) -> None:
        """A Publish was taken."""

    def registration(self, transfer_id: str, traceparent: str) -> None:
        """A decode daemon's Register arrived with its span's context."""

    def rendezvous(self, worker_id: str, transfer_id: str, waited_s: float, peer: str) -> None:
        """The second of publish and registration arrived ``waited_s`` after the first: a WRITE starts."""

    # both
    def nixl_done(self, worker_id: str, transfer_id: str, read: bool, x: WriteResult | ReadResult) -> None:
        """A WRITE (prefill) or READ (decode, pull) this daemon posted is done."""

    def delivered(self, worker_id: str, side: str, c: Completion) -> None:
        """The transfer's completion went to the worker: its span ends."""

    def forget_worker(self, worker_id: str) -> None:
        """The worker is gone: spans of its transfers that will get no completion end."""

    def shutdown(self) -> None:
        """Flush and stop the exporter (safe to call twice)."""
