"""RecentWork: the prompt tokens each instance was sent to compute lately, decayed.

Load (an instance's running and waiting requests, this proxy's in flight) falls to 0 as soon as
its requests finish: when requests come one at a time, it tells the instances apart by nothing.
What they were given to compute lately does. Per instance: the prompt tokens it lacked from its
cache when the router sent it a request (what it prefills, or a D receives from its P: a new
prefix's whole prompt, a cached prefix's suffix), each weighing half as much every
``half_life_s``::

    work(now) = sum over requests k sent there of  num_lacked_k * 2 ** (-(now - t_k) / half_life_s)

kept as one number per instance, decayed when read or added to. Counting computed tokens, not
all prompt tokens, makes an instance's work grow with the prefixes it took on and with the
traffic they draw, and leaves a hit free, as it is to the instance.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Seconds after which a token sent to compute counts half as much.
HALF_LIFE_S = 60.0


class RecentWork:
    def __init__(
        self, half_life_s: float = HALF_LIFE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self.clock = clock
        #: instance -> (work, when it was last decayed)
        self._work: dict[str, tuple[float, float]] = {}

    def add(self, name: str, num_tokens: int) -> None:
        """``name`` was sent ``num_tokens`` prompt tokens to compute now."""
        self._work[name] = (self.get(name) + num_tokens, self.clock())

    def get(self, name: str) -> float:
        """The decayed prompt tokens ``name`` was sent to compute (0.0: none lately)."""
        work, since = self._work.get(name, (0.0, 0.0))
        return work * 2.0 ** (-(self.clock() - since) / self.half_life_s) if work else 0.0
