"""Test-only fault injection for the transfer thread, off unless KVPUSHD_FAULTS is set at start.

``KVPUSHD_FAULTS="write_post=0.1,write_complete=0.05,write_hold_s=2,seed=7"``:

- ``write_post=P``: with probability P a WRITE is refused before it is posted (as if NIXL could
  not post it);
- ``write_complete=P``: with probability P a WRITE is posted without its notification and then
  reported as completed in error (as a WRITE the network broke: the decode daemon never hears of
  it and learns of the failure only from the prefill daemon's notice);
- ``write_hold_s=S``: every WRITE is reported done no sooner than S seconds after it was posted
  (a slow network), e.g. to check that leases do not expire WRITEs in flight;
- ``seed=N``: seeds the draws (default: random).

Meant for tests and the soak benchmark; the daemon logs a warning at start when it is set.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from ..core.errors import InvalidArgument

ENV = "KVPUSHD_FAULTS"
_KINDS = ("write_post", "write_complete")


@dataclass
class Faults:
    write_post: float = 0.0
    write_complete: float = 0.0
    write_hold_s: float = 0.0
    spec: str = ""
    rng: random.Random = field(default_factory=random.Random)
    injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_KINDS, 0))

    @classmethod
    def parse(cls, spec: str) -> Faults:
        f = cls(spec=spec)
        for item in filter(None, (x.strip() for x in spec.split(","))):
            key, sep, value = item.partition("=")
            try:
                v = float(value)
            except ValueError:
                v = -1.0
            if not sep or key not in (*_KINDS, "write_hold_s", "seed") or v < 0 or (key in _KINDS and v > 1):
                raise InvalidArgument(f"{ENV}: {item!r} is not one of write_post=P, write_complete=P (0 <= P <= 1), "
                                      "write_hold_s=S, seed=N")
            if key == "seed":
                f.rng.seed(int(v))
            else:
                setattr(f, key, v)
        return f

    @classmethod
    def from_env(cls) -> Faults:
        return cls.parse(os.environ.get(ENV, ""))

    @property
    def active(self) -> bool:
        return bool(self.write_post or self.write_complete or self.write_hold_s)

    def on_post(self) -> str:
        """Which fault (if any) this WRITE gets: "", "write_post" or "write_complete"."""
        for kind in _KINDS:
            p = getattr(self, kind)
            if p and self.rng.random() < p:
                self.injected[kind] += 1
                return kind
        return ""
