"""A KV connector's own plain data across the executor's channels: the scheduler half's
per-step metadata down to every rank, each rank's ``worker_meta`` back up.

Both are dataclasses of the connector's own types, which msgspec encodes but cannot decode
without knowing the type. Each is therefore sent as ``[type name, fields]``: the name is
``module:qualname``, resolved only to a dataclass defined under ``pagedkv.kv_transfer`` (no
other class is ever built from the wire, and nothing runs but the dataclass's constructor).
A ``MultiConnectorMetadata``'s children, and a composite's tuple of children's metas, are
sent the same way, each child by its own name. A rank's whole ``KVConnectorOutput`` goes up as
its fields, its ``worker_meta`` so encoded (``encode_output``).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import msgspec

from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_transfer.multi.metadata import MultiConnectorMetadata

_PACKAGE = "pagedkv.kv_transfer."
_TUPLE = "tuple"


def _type_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(name: str) -> type:
    """The dataclass ``name`` names; ValueError for anything else."""
    module_name, _, qualname = name.partition(":")
    if not module_name.startswith(_PACKAGE) or not qualname.isidentifier():
        raise ValueError(f"not a KV connector type: {name!r}")
    cls = getattr(importlib.import_module(module_name), qualname, None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"not a KV connector dataclass: {name!r}")
    return cls


def encode_plain(obj: Any) -> Any:
    """``obj`` (None, a connector dataclass, or a tuple of those) as msgpack-ready data."""
    if obj is None:
        return None
    if isinstance(obj, tuple):
        return [_TUPLE, [encode_plain(item) for item in obj]]
    if isinstance(obj, MultiConnectorMetadata):
        children = [encode_plain(child) for child in obj.children]
        return [_type_name(obj), [children, obj.holders, obj.loaders]]
    return [_type_name(obj), msgspec.to_builtins(obj)]


def decode_plain(data: Any) -> Any:
    """The object ``encode_plain`` encoded."""
    if data is None:
        return None
    name, fields = data
    if name == _TUPLE:
        return tuple(decode_plain(item) for item in fields)
    cls = _resolve(name)
    if cls is MultiConnectorMetadata:
        children, holders, loaders = fields
        return MultiConnectorMetadata(
            children=tuple(decode_plain(child) for child in children),
            holders={req: tuple(positions) for req, positions in holders.items()},
            loaders={req: tuple(positions) for req, positions in loaders.items()},
        )
    return msgspec.convert(fields, cls)


def encode_output(output: KVConnectorOutput | None) -> dict | None:
    if output is None:
        return None
    fields = msgspec.to_builtins(dataclasses.replace(output, worker_meta=None))
    fields["worker_meta"] = encode_plain(output.worker_meta)
    return fields


def decode_output(fields: dict | None) -> KVConnectorOutput | None:
    if fields is None:
        return None
    meta = decode_plain(fields.pop("worker_meta"))
    return dataclasses.replace(msgspec.convert(fields, KVConnectorOutput), worker_meta=meta)
