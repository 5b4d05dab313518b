"""The push rendezvous, as two pure state machines.

SendSide lives on the prefill node: it matches each producer rank's "prefill done" (publish) with
the decode side's registrations (forwarded by the decode node's daemon), in either order; the
second arrival starts the WRITE of one *leg* (producer rank -> one registration).
RecvSide lives on the decode node: one record per Expect, counting one notification per producer
rank that writes to it.

Pull mode (per registration, ``Registration.mode``): when a pull registration meets its publish,
SendSide does not write; it offers the source blocks to the decode daemon (``SendOffer``), whose
RecvSide validates the offer against its registration and READs them (``StartRead``). The leg stays
in flight on the prefill side until the READ's notification arrives (``read_done``), the decode
daemon reports the READ failed (``SendReadFailed`` -> ``read_done(ok=False)``), is lost, or
``publish_timeout_s`` passes after the offer.

Nothing here performs I/O: every event returns a list of actions for the runtime to carry out
(``StartWrite``, ``StartRead``, ``Deliver``, ``SendRegister``, ``SendFailNotice``, ``SendWithdraw``,
``SendOffer``, ``SendReadFailed``; ``Dropped`` for a late event ignored on purpose), and time is an
argument. Each side reports its next deadline, so the runtime arms one timer and calls ``tick``.
A withdrawal's FAILED is held by the core until the runtime reports the prefill daemon's answer
(``RecvSide.withdraw_answered``). What each event does in each state of a record is a table
(core/table.py): on the prefill side per publish, registration and leg (``PUB_TABLE``,
``REG_TABLE``, ``LEG_TABLE``, sendstate.py), on the decode side per receive and mode
(``RECV_TABLE``, recv.py); anything a table does not name is IllegalTransition. Deadline keys are
typed (``PublishLease``, ``RegistrationLease``, ``PullLease``; ``ExpectLease``).

Pure logic: no asyncio, grpc, nixl or torch. Modules: actions.py (what the core decides), send.py
(prefill side: its records and tables in sendstate.py, what a leg carries in legplan.py), recv.py
(decode side), deadlines.py, table.py, ledger.py (a transfer's books), layout.py (block geometry);
each name is imported from the module that defines it.

Invariants (checked by the Hypothesis state machine in tests/core/test_core_stateful.py):
- every Publish and every Expect ends with exactly one terminal Completion to its worker, unless the
  worker itself is gone or replaced the Expect;
- a leg is written at most once;
- a publish is not reported finished or failed while one of its WRITEs may still be in flight, so
  the prefill worker never frees blocks that NIXL is still reading.
"""
