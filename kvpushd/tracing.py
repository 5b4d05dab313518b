"""Transfer tracing: the hooks the runtime calls, and a no-op default.

Off (no ``[tracing] otlp_endpoint``) the runtime holds a ``Tracing`` whose ``enabled`` is False and
checks that flag before each hook, so a transfer pays one attribute read per hook and opentelemetry
is never imported. On, ``telemetry.make_tracing`` loads ``kvpushd.otel`` (the only module that imports
opentelemetry), which exports spans over OTLP/gRPC.

Spans per transfer (all in the trace of the engine request's W3C ``traceparent`` when one came),
made from the transfer's ledger (core/ledger.py) when it ends, with the times it stamped:

- decode daemon: ``kvpushd.recv`` (Expect -> completion), children ``kvpushd.register`` (the
  Register call to the prefill daemon), ``kvpushd.wait_notifications`` (registered -> completion;
  push) or ``kvpushd.nixl_read`` (pull). Its context is chosen when the first Register goes, which
  carries it.
- prefill daemon: ``kvpushd.send`` (first of Publish/Register -> completion; parent: the decode daemon's
  ``kvpushd.recv`` from Register, else the Publish's traceparent, which is then a link), children
  ``kvpushd.rendezvous_wait`` (first of publish/registration -> the second) and ``kvpushd.nixl_write``
  (the first WRITE posted -> the last one's bytes landed, with the WRITEs' bytes and descriptors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core.ledger import Ledger
    from .core.types import Completion


class Tracing:
    """No tracing: every hook does nothing (the runtime skips them while ``enabled`` is False)."""

    enabled = False

    def register_context(self, led: Ledger) -> str:
        """Decode: the traceparent to send in Register (the context the transfer's span will have,
        kept in ``led.span_context``); "" when none."""
        return ""

    def ended(self, c: Completion, led: Ledger) -> None:
        """The transfer ended (``c`` went to its worker, or its worker is gone): its spans, from ``led``."""

    def shutdown(self) -> None:
        """Flush and stop the exporter (safe to call twice)."""
