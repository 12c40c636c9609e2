"""After a load: does every instance come back to rest? ``wait_settled`` polls each instance's
``/metrics`` until no request runs or waits and no KV block is in use, or a timeout passes.

A prefill instance may hold a finished request's blocks until its decode instance has them
(or the transfer's lease ends), so a short settle time is normal; blocks still in use after
it mean a leak, and a request still running means one was stranded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: Gauge -> the value it must come back to.
AT_REST = {
    "pagedkv:num_requests_running": 0.0,
    "pagedkv:num_requests_waiting": 0.0,
    "pagedkv:kv_cache_usage_perc": 0.0,
}


@dataclass
class InstanceState:
    base_url: str
    settled: bool = False
    #: The last values read of the ``AT_REST`` gauges (missing: never read).
    gauges: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def describe(self) -> str:
        if self.error is not None:
            return f"{self.base_url}: {self.error}"
        values = ", ".join(f"{k.removeprefix('pagedkv:')}={v:g}" for k, v in self.gauges.items())
        return f"{self.base_url}: {'at rest' if self.settled else 'NOT at rest'} ({values})"


def read_gauges(client: httpx.Client, base_url: str) -> dict[str, float]:
    """The ``AT_REST`` gauges of one instance (summed over label sets)."""
    response = client.get(f"{base_url}/metrics")
    response.raise_for_status()
    gauges = dict.fromkeys(AT_REST, 0.0)
    seen = set()
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in gauges:
                gauges[sample.name] += sample.value
                seen.add(sample.name)
    missing = set(AT_REST) - seen
    if missing:
        raise ValueError(f"/metrics lacks {sorted(missing)}: not a pagedkv instance?")
    return gauges


def wait_settled(
    base_urls: list[str], timeout_s: float = 30.0, poll_s: float = 0.1
) -> list[InstanceState]:
    """Poll every instance until all are at rest or ``timeout_s`` passes; one state each."""
    states = [InstanceState(url.rstrip("/")) for url in base_urls]
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while True:
            for state in states:
                if state.settled:
                    continue
                try:
                    state.gauges = read_gauges(client, state.base_url)
                    state.error = None
                except (httpx.HTTPError, ValueError) as e:
                    state.error = f"{type(e).__name__}: {e}"
                    continue
                state.settled = state.gauges == AT_REST
            if all(s.settled for s in states) or time.monotonic() > deadline:
                return states
            time.sleep(poll_s)
