"""``kvpushd demo``: the main job on built-in defaults, on one machine.

Two modes, both with a prefill-node daemon and a decode-node daemon as real processes:

``--mode engine`` (default): a prefill engine process and a decode engine process, each running the
reference engine (``kvpushd_lab.refengine``: a tiny deterministic transformer with a paged KV cache in
vLLM's HND layout over shared memory) with ``KVPushdHooks`` attached through its own node's daemon,
one worker per TP rank. The orchestrator dispatches requests concurrently in both arrival orders
(decode first: decode registers its blocks before prefill runs; prefill first: decode gets the
request after prefill finished) and checks three things per request: the decode engine's tokens
equal a monolithic run of the same model (computed here), the KV the decode engine received is
byte for byte the KV the prefill engine computed (both sides snapshot the request's blocks, all
layers, heads gathered over the TP ranks: prefill when its blocks are complete, decode the moment
the transfer is reported finished, before it decodes), and nothing outside a request's blocks was
written on the decode side (free blocks hold poison; allocations check it, frees restore it).

``--mode bytes``: two stand-in workers move random bytes in the same kind of layout (layers x K/V x
blocks). Every destination block is checked byte for byte against its source; freed destination
blocks are re-poisoned, so at the end the whole decode memory must be poison again: any byte written
outside a request's blocks shows up as a mismatch.
"""

from .engine_proc import run_engine_child
from .options import add_args
from .run import run_demo

__all__ = ["add_args", "run_demo", "run_engine_child"]
