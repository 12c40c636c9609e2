"""KVTransferParams: a request's ``kv_transfer_params``, one typed struct under vLLM's names.

The proxy mints them (``to_dict``); the connectors read them from a request (``parse``) and
answer with them. On the wire they stay a JSON object with vLLM's keys::

    to P: {"do_remote_decode": true, "transfer_id", "remote_engine_id", "remote_host",
           "remote_port", "remote_tp_size"}    <- D's address: only D may pull the KV
    to D: {"do_remote_prefill": true, "transfer_id", "remote_engine_id", "remote_host",
           "remote_port", "remote_tp_size"}    <- P's address: where the KV is

``remote_tp_size`` is the other instance's tensor-parallel size (absent: the same as the
reader's); the P2P connector plans which ranks exchange which KV heads from it.
    from a store P: {"do_remote_prefill": true, "store_num_tokens"}

A request's params are client input, read on the engine thread. Each reader parses only the
fields it reads; the first malformed one raises a ValueError naming it
(``kv_transfer_params.remote_port: ...``), and the reader decides what that costs (a failed
load, a KV not sent, a value ignored). Other fields, like unknown keys, are ignored; JSON null
is an absent field. A flag that is present and not false asks for its transfer even when
malformed, so the transfer fails naming the flag instead of silently not happening.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, get_args

import msgspec

from pagedkv.transport.peer_addr import MAX_ENGINE_ID_LEN, PeerAddr, check_host

MAX_TRANSFER_ID_LEN = 256

TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TRANSFER_ID_LEN)]
EngineId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ENGINE_ID_LEN)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
TokenCount = Annotated[int, msgspec.Meta(ge=0)]
TPSize = Annotated[int, msgspec.Meta(ge=1, le=1024)]


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    #: D: the prompt's KV comes from elsewhere (P, at the address below; or the store).
    do_remote_prefill: bool = False
    #: P: another instance decodes; keep the prompt's KV for it.
    do_remote_decode: bool = False
    #: The proxy's id of one P-to-D handoff (never derived from a request id).
    transfer_id: TransferId | None = None
    #: The other side: P's engine on D (where the KV is), D's on P (the only one that may
    #: pull it; absent: any peer that knows the transfer id).
    remote_engine_id: EngineId | None = None
    remote_host: str | None = None
    remote_port: Port | None = None
    #: The other side's tensor-parallel size (None: the same as this instance's).
    remote_tp_size: TPSize | None = None
    #: Store connector, P's answer: the prompt tokens whose blocks it put in the store.
    store_num_tokens: TokenCount | None = None

    @classmethod
    def handoff(
        cls,
        transfer_id: str,
        remote: PeerAddr,
        *,
        to: Literal["prefill", "decode"],
        remote_tp_size: int | None = None,
    ) -> KVTransferParams:
        """One side of a P-to-D handoff: what P gets (keep the KV for D at ``remote``) or what
        D gets (load it from P at ``remote``); ``remote_tp_size``: that instance's size."""
        return cls(
            do_remote_decode=to == "prefill",
            do_remote_prefill=to == "decode",
            transfer_id=transfer_id,
            remote_engine_id=remote.engine_id,
            remote_host=remote.host,
            remote_port=remote.port,
            remote_tp_size=remote_tp_size,
        )

    @classmethod
    def parse(
        cls,
        raw: Mapping[str, Any] | None,
        fields: Iterable[str] | None = None,
        required: Iterable[str] = (),
    ) -> KVTransferParams:
        """The ``fields`` of ``raw`` (all by default), checked in declaration order; ValueError
        naming the first malformed one, or the first of ``required`` that is absent."""
        names = set(_TYPES if fields is None else fields)
        unknown = names - set(_TYPES)
        assert not unknown, f"not fields of KVTransferParams: {unknown}"
        values: dict[str, Any] = {}
        for name, type_ in _TYPES.items():
            value = (raw or {}).get(name)
            if name not in names or value is None:
                continue
            try:
                values[name] = msgspec.convert(value, type_)
                if name == "remote_host":
                    check_host(value)
            except (msgspec.ValidationError, ValueError) as e:
                raise ValueError(f"kv_transfer_params.{name}: {e}") from None
        for name in required:
            if name not in values:
                raise ValueError(f"kv_transfer_params.{name}: missing")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The wire form: vLLM's keys, fields left at their defaults omitted."""
        return msgspec.to_builtins(self)


def _without_none(type_: Any) -> Any:
    """``X | None`` -> ``X`` (a null value is dropped as absent before it is converted)."""
    members = [t for t in get_args(type_) if t is not type(None)]
    return members[0] if members else type_


#: Each field's type, in declaration order.
_TYPES: dict[str, Any] = {
    field.name: _without_none(field.type) for field in msgspec.structs.fields(KVTransferParams)
}


def asks_for(raw: Mapping[str, Any] | None, flag: str) -> bool:
    """The request sets ``flag`` (``do_remote_prefill`` / ``do_remote_decode``): present and
    not false. A malformed value asks too; ``parse`` then names it."""
    value = (raw or {}).get(flag)
    return value is not None and value is not False
