"""KVOutputAggregator: one KV connector report from every rank's (vLLM's aggregator).

Each rank moves only its own heads of a request's KV, so a send or a load has ended only once
every rank has reported it: a request enters ``finished_sending`` / ``finished_recving`` in
the step where the last rank reports it. Everything else passes through at once: the union of
the failed blocks and of the loads still in progress, the first error per request, and the
ranks' ``worker_meta`` combined by the connector's own rule (``combine_worker_meta``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.kv_connector.output import KVConnectorOutput


class KVOutputAggregator:
    def __init__(self, world_size: int, combine_worker_meta: Callable[[list[Any]], Any]) -> None:
        self.world_size = world_size
        self._combine = combine_worker_meta
        #: Request id -> ranks that reported its send (load) ended, until all have.
        self._sending: Counter[str] = Counter()
        self._recving: Counter[str] = Counter()

    def aggregate(self, outputs: Sequence[KVConnectorOutput | None]) -> KVConnectorOutput:
        """This step's report of the instance, from each rank's (rank order)."""
        out = KVConnectorOutput()
        metas = []
        for output in outputs:
            if output is None:
                metas.append(None)
                continue
            self._sending.update(output.finished_sending)
            self._recving.update(output.finished_recving)
            out.invalid_block_ids |= output.invalid_block_ids
            out.loads_in_progress |= output.loads_in_progress
            out.load_errors = {**output.load_errors, **out.load_errors}
            metas.append(output.worker_meta)
        out.finished_sending = self._take_complete(self._sending)
        out.finished_recving = self._take_complete(self._recving)
        if any(meta is not None for meta in metas):
            out.worker_meta = self._combine(metas)
        return out

    def _take_complete(self, counts: Counter[str]) -> set[str]:
        done = {req_id for req_id, n in counts.items() if n >= self.world_size}
        for req_id in done:
            del counts[req_id]
        return done
