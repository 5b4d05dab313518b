"""Progressive push on the worker: which doorbell a worker rings, and how far a step has got.

A prefill request is declared in the step that computes its prompt's last tokens (scheduler.py); the
worker queues it before the forward with that step's doorbell number and its layer-group count, and
``save_kv_layer`` rings the doorbell as layers finish. The daemon's regions (layout.py) are its unit:
it splits them, in order, into ``layers`` equal groups and writes group g once the doorbell says g
groups are done. So a ring must count whole groups whose every region is written:

* a region is written once every layer that views it ran (one layer usually; one layer of each KV
  cache group where a hybrid model's groups share an allocation);
* the group count is the coarsest one that loses no progress: one group per attention layer for
  vLLM's packed layout (one region per layer), for K and V kept apart (two per layer) and for
  head-outer layouts; one group per region where several layers share a region;
* a ring says how many LEADING groups are complete, whatever order the layers ran in.

The doorbell is chosen in one place (``make_doorbell``): host KV rings a ``Doorbell`` in shared
memory from the engine thread; CUDA KV a ``GpuDoorbell`` (kvpushd_client.gpu_doorbell) whose rings
the forward's CUDA stream writes when it gets there (the engine thread runs ahead of the GPU). Where
the GPU doorbell cannot be made (no CUDA driver, no stream memory operations nor copy), the worker
publishes declared requests whole after the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..gpu_doorbell import GpuDoorbellError
from ..gpu_doorbell import make_doorbell as doorbell_for
from .utils import logger


class Bell(Protocol):
    """What the worker needs of a doorbell (``kvpushd_client.doorbell.Doorbell``, or a GPU one)."""

    name: str
    seq: int

    def step(self) -> int: ...
    def layer_done(self, n: int) -> None: ...
    def seal(self) -> None: ...
    def close(self) -> None: ...


def make_doorbell(kv_caches: dict[str, Any]) -> Bell | None:
    """The doorbell this worker rings (a GPU one rings on torch's current stream: the one the forward
    writes the KV on), or None (progressive push not possible here: why is logged)."""
    try:
        return doorbell_for(kv_on_cuda=next(iter(kv_caches.values())).is_cuda)
    except GpuDoorbellError as e:
        logger.warning("kvpushd: no GPU doorbell for this CUDA KV (%s)", e)
        return None


class LayerProgress:
    """Layer name -> how many leading layer groups of this step are complete (the engine thread's).

    ``owners``: per region, in the daemon's order, the layers whose KV it holds (layout.py)."""

    def __init__(self, owners: Sequence[Sequence[str]]) -> None:
        from .layout import natural_key  # torch: the worker's import, not the scheduler's

        names = sorted({n for o in owners for n in o}, key=natural_key)  # forward order
        self.index = {n: i for i, n in enumerate(names)}
        self._regions_of: list[list[int]] = [[] for _ in names]
        for r, o in enumerate(owners):
            for n in set(o):
                self._regions_of[self.index[n]].append(r)
        self._need0 = [len(set(o)) for o in owners]
        n_regions = len(owners)
        # where each region becomes complete when layers run in forward order
        done_at = [max(self.index[n] for n in o) for o in owners]
        self.per_group = next(s for s in range(n_regions, 0, -1) if n_regions % s == 0 and all(
            len(set(done_at[g:g + s])) == 1 for g in range(0, n_regions, s)))
        self.layers = n_regions // self.per_group  # the layer groups a declared publish names
        self.in_order = done_at == sorted(done_at)
        self.reset()

    def reset(self) -> None:
        """A new step: nothing written yet."""
        self._need = list(self._need0)
        self._ran = [False] * len(self._regions_of)
        self._regions_done = 0
        self.groups_done = 0

    def layer_done(self, name: str) -> int:
        """Layer ``name`` has written its KV in this step; -> complete leading groups when that grew, else 0."""
        i = self.index.get(name)
        if i is None or self._ran[i]:
            return 0
        self._ran[i] = True
        need = self._need
        for r in self._regions_of[i]:
            need[r] -= 1
        k, n = self._regions_done, len(need)
        while k < n and need[k] == 0:
            k += 1
        self._regions_done = k
        groups = k // self.per_group
        if groups > self.groups_done:
            self.groups_done = groups
            return groups
        return 0
