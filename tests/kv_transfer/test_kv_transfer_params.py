"""KVTransferParams: vLLM's wire names, a malformed field named, unknown keys ignored."""

from __future__ import annotations

import json

import pytest

from pagedkv.kv_connector.params import KVTransferParams, asks_for
from pagedkv.transport.peer_addr import PeerAddr

#: What the proxy sends D (P's address).
TO_D = {
    "do_remote_prefill": True,
    "transfer_id": "5c1f",
    "remote_engine_id": "P-0",
    "remote_host": "10.0.0.7",
    "remote_port": 14579,
}

#: Per field: values a client may send that are not a valid one.
MALFORMED = {
    "do_remote_prefill": [1, 0, "true", [], {}],
    "do_remote_decode": [1, "yes", [True]],
    "transfer_id": ["", "t" * 257, 7, ["t"], True],
    "remote_engine_id": ["", "e" * 257, 7, {"id": "P"}],
    "remote_host": ["foo bar", "*", "\x00", "h" * 254, "-lead", "évil", "h:1", 5, ["h"]],
    "remote_port": [0, 65536, -1, True, "5", 5.0, 2**70],
    "store_num_tokens": [-1, "48", 48.0, True, float("nan"), float("inf"), [1], -(2**70)],
}


def test_the_proxys_params_round_trip_under_vllms_names() -> None:
    p = PeerAddr("P-0", "10.0.0.7", 14579)
    params = KVTransferParams.handoff("5c1f", p, to="decode")
    assert params.to_dict() == TO_D  # fields left at their defaults are not sent
    assert KVTransferParams.parse(TO_D) == params
    to_p = KVTransferParams.handoff("5c1f", PeerAddr("D-0", "::1", 80), to="prefill").to_dict()
    assert to_p == {"do_remote_decode": True, "transfer_id": "5c1f",
                    "remote_engine_id": "D-0", "remote_host": "::1", "remote_port": 80}  # fmt: skip
    assert json.loads(json.dumps(params.to_dict())) == TO_D
    store = KVTransferParams(do_remote_prefill=True, store_num_tokens=48).to_dict()
    assert store == {"do_remote_prefill": True, "store_num_tokens": 48}
    for host in ("::1", "[::1]", "localhost", "p-0.pods.local", "my_service"):
        assert KVTransferParams.parse({**TO_D, "remote_host": host}).remote_host == host


@pytest.mark.parametrize(
    ("field", "value"), [(field, value) for field, values in MALFORMED.items() for value in values]
)
def test_a_malformed_field_is_named(field, value) -> None:
    with pytest.raises(ValueError, match=rf"^kv_transfer_params\.{field}: "):
        KVTransferParams.parse({**TO_D, field: value})
    # A reader that does not read the field is not bothered by it.
    others = [name for name in MALFORMED if name != field]
    assert KVTransferParams.parse({**TO_D, field: value}, others) == KVTransferParams.parse(
        {name: v for name, v in TO_D.items() if name != field}
    )


def test_the_first_malformed_field_in_declaration_order_is_named() -> None:
    raw = {"remote_port": 0, **{k: v for k, v in TO_D.items() if k != "remote_port"}}
    raw["remote_host"] = "a b"  # after remote_port in the input, before it in the struct
    with pytest.raises(ValueError, match=r"^kv_transfer_params\.remote_host: "):
        KVTransferParams.parse(raw)


def test_unknown_keys_are_ignored_and_null_is_absent() -> None:
    raw = {**TO_D, "fail_from_block": 3, "x": {"nested": [1, None]}, "store_num_tokens": None}
    assert KVTransferParams.parse(raw) == KVTransferParams.parse(TO_D)
    assert KVTransferParams.parse(None) == KVTransferParams()
    assert KVTransferParams.parse({"transfer_id": None}).transfer_id is None


def test_a_required_field_that_is_absent_is_named() -> None:
    raw = {k: v for k, v in TO_D.items() if k != "remote_port"}
    with pytest.raises(ValueError, match=r"^kv_transfer_params\.remote_port: missing$"):
        KVTransferParams.parse(raw, required=["transfer_id", "remote_port"])
    with pytest.raises(ValueError, match=r"remote_host: missing"):
        KVTransferParams.parse({**TO_D, "remote_host": None}, required=["remote_host"])


def test_a_flag_asks_unless_absent_null_or_false() -> None:
    for value in (True, 1, 0, "", "no", [], {}):
        assert asks_for({"do_remote_prefill": value}, "do_remote_prefill"), value
    for raw in (None, {}, {"do_remote_prefill": None}, {"do_remote_prefill": False}):
        assert not asks_for(raw, "do_remote_prefill"), raw
    assert not asks_for({"do_remote_prefill": True}, "do_remote_decode")
