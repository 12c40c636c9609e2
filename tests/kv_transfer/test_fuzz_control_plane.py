"""Fuzzed control-plane input: frames of random bytes, valid messages mutated, and random or
well-typed msgpack structures of every kind under valid (signed) envelopes. ``Codec.decode``
only ever returns a message of the declared type or raises ``ProtocolError``; with a secret,
no altered message is ever accepted; the proxy's registry survives fuzzed registrations and
keeps only ones it can use. (Fuzz against real engines' listeners: test_p2p_engines.py.)"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.entrypoints.openai.registration_client import RegistrationClient
from pagedkv.entrypoints.proxy.registry import InstanceRegistry
from pagedkv.entrypoints.proxy.router import Router
from pagedkv.entrypoints.serving.registration import REGISTRY_MESSAGES, Register, registry_codec
from pagedkv.kv_connector.config import KV_ROLES
from pagedkv.kv_transfer.p2p.protocol import MESSAGE_TYPES
from pagedkv.transport.codec import PROTOCOL_VERSION, Codec, ProtocolError
from pagedkv.transport.peer_addr import PeerAddr
from tests.kv_transfer.wire import raw_frames
from tests.ports import free_port

SECRET = b"fuzz-secret"
FUZZ = settings(max_examples=200, deadline=None)

# ---------------------------------------------------------------------------- strategies
MSGPACK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
IDS = st.sampled_from(["t", "g", "", "x" * 300]) | st.text(max_size=12)
#: Fields whose valid values random text would almost never hit.
BY_NAME = {
    "role": st.sampled_from([*KV_ROLES, "kv_all", ""]),
    "http_url": st.sampled_from(
        ["http://127.0.0.1:1", "https://d.local/x", "http://h:x", "ftp://h", "http://a\nb", "/v1"]
    )
    | IDS,  # fmt: skip
}


def typed(annotation) -> st.SearchStrategy:
    """Values of a message field's declared type (so decoding succeeds and handlers run),
    with odd ones among them (empty, huge, negative)."""
    if annotation is str:
        return IDS
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.sampled_from([0, 1, -1])
    if annotation is bytes:
        return st.binary(max_size=64)
    args = getattr(annotation, "__args__", ())
    if args:  # list[...]
        return st.lists(typed(args[0]), max_size=6)
    return MSGPACK


def payloads(message_types: dict[str, type[msgspec.Struct]]) -> st.SearchStrategy:
    """(kind, payload): a well-typed dict for a kind (some keys missing or extra), or any
    msgpack value under any kind."""

    def well_typed(kind: str) -> st.SearchStrategy:
        fields = msgspec.structs.fields(message_types[kind])
        return st.fixed_dictionaries(
            {},
            optional={f.encode_name: BY_NAME.get(f.name, typed(f.type)) for f in fields}
            | {"extra": MSGPACK},
        ).map(lambda d, k=kind: (k, d))

    kinds = st.sampled_from(sorted(message_types))
    return kinds.flatmap(well_typed) | st.tuples(kinds | st.text(max_size=10), MSGPACK)


SENDERS = st.tuples(
    st.text(max_size=8).map(lambda s: f"fuzz-{s}"),
    st.sampled_from(["127.0.0.1", "localhost", "a b", "*", ""]),
    st.integers(min_value=-1, max_value=70_000),
)


def message_frames(codec: Codec, message_types) -> st.SearchStrategy:
    """Frames a buggy peer holding the secret could send."""
    signed = st.builds(
        lambda kp, sender, version: raw_frames(codec, kp[0], kp[1], sender, version),
        payloads(message_types),
        SENDERS,
        st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, PROTOCOL_VERSION + 1, 0]),
    )
    junk = st.lists(st.binary(max_size=300), min_size=1, max_size=5)  # ZMQ sends >= 1 frame
    return signed | junk


# ---------------------------------------------------------------------------- the codec
def _decode(codec: Codec, frames: list[bytes]):
    try:
        return codec.decode(frames)
    except ProtocolError as e:
        return e


@FUZZ
@given(data=st.data())
def test_decoding_yields_a_declared_message_or_a_protocol_error(data) -> None:
    for secret in (SECRET, None):
        codec = Codec("fp", secret, 4096, MESSAGE_TYPES)
        frames = data.draw(message_frames(codec, MESSAGE_TYPES))
        result = _decode(codec, frames)
        if not isinstance(result, ProtocolError):
            envelope, message = result
            assert type(message) is MESSAGE_TYPES[envelope.kind]
            assert isinstance(envelope.sender, PeerAddr)  # checked: a usable address


@FUZZ
@given(data=st.data())
def test_with_a_secret_no_altered_message_is_accepted(data) -> None:
    codec = Codec("fp", SECRET, 4096, MESSAGE_TYPES)
    kind, payload = data.draw(payloads(MESSAGE_TYPES).filter(lambda kp: kp[0] in MESSAGE_TYPES))
    original = raw_frames(codec, kind, payload, ("fuzz-a", "127.0.0.1", 5))
    frames = list(original)
    i = data.draw(st.integers(0, 2))
    how = data.draw(st.sampled_from(["truncate", "flip", "append", "replace"]))
    raw = frames[i]
    if how == "truncate":
        frames[i] = raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)))]
    elif how == "flip" and raw:
        at = data.draw(st.integers(0, len(raw) - 1))
        frames[i] = raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1 :]
    elif how == "append":
        frames[i] = raw + data.draw(st.binary(min_size=1, max_size=8))
    else:
        frames[i] = data.draw(st.binary(max_size=64))
    result = _decode(codec, frames)
    if frames != original:
        assert isinstance(result, ProtocolError), (how, i)


# ---------------------------------------------------------------------------- the registry
@pytest.fixture(scope="module")
def registry_under_fuzz():
    """A registry with a secret, and a DEALER connected to it (the fuzzer's)."""
    registry = InstanceRegistry("127.0.0.1", free_port(), SECRET, timeout_s=30)
    registry.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(registry._plane.address.endpoint)
    try:
        yield registry, dealer
    finally:
        dealer.close(linger=0)
        ctx.term()
        registry.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(message_frames(registry_codec(SECRET), REGISTRY_MESSAGES), max_size=8))
def test_fuzzed_registrations_never_break_the_registry(registry_under_fuzz, batch) -> None:
    registry, dealer = registry_under_fuzz
    for frames in batch:
        dealer.send_multipart(frames)


def test_after_the_fuzz_the_registry_holds_only_usable_instances(registry_under_fuzz) -> None:
    registry, dealer = registry_under_fuzz
    port = registry._plane.address.port
    me = PeerAddr("real-d", "127.0.0.1", 4242)
    info = Register("kv_consumer", "http://127.0.0.1:8000", "m", "fp")
    client = RegistrationClient("127.0.0.1", port, me, lambda: info, SECRET, interval_s=0.1)
    client.start()
    try:
        deadline = time.monotonic() + 10
        while "real-d" not in {i.engine_id for i in registry.live()}:
            assert time.monotonic() < deadline, "a real instance could not register"
            time.sleep(0.05)
    finally:
        client.close()
    assert sum(registry.rejected.values()) > 0
    for instance in registry.live():
        assert instance.info.role in KV_ROLES and instance.engine_id
        Register(**msgspec.structs.asdict(instance.info))  # passes its own checks
    router = Router(registry, "least_loaded")
    for _ in range(5):
        router.route()  # never raises, whatever registered
