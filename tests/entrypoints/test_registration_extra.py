"""Where ``pagedkv serve`` reads its proxy registration settings from a kv_transfer_config:
the connector's extra config, or a MultiConnector's children's."""

from __future__ import annotations

from pagedkv.entrypoints.openai.registration import RegistrationConfig, registration_extra_config


def test_a_single_connectors_extra_config_is_read_as_it_is() -> None:
    config = {"kv_connector": "P2pConnector", "kv_connector_extra_config": {"proxy_port": 1}}
    assert registration_extra_config(config) == {"proxy_port": 1}
    assert registration_extra_config(None) == {}


def test_a_multi_connectors_children_are_read_the_first_child_winning() -> None:
    p2p = {
        "kv_connector": "P2pConnector",
        "kv_connector_extra_config": {
            "proxy_ip": "127.0.0.1",
            "proxy_port": 30001,
            "proxy_heartbeat_s": 0.5,
            "shared_secret": "s3",
        },
    }
    store = {
        "kv_connector": "StoreConnector",
        "kv_connector_extra_config": {"store_url": "file:///tmp/s", "proxy_heartbeat_s": 9},
    }
    multi = {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {"connectors": [p2p, store, "not a config"]},
    }
    extra = registration_extra_config(multi)
    assert extra["proxy_heartbeat_s"] == 0.5
    registration = RegistrationConfig.from_args(None, extra)
    assert (registration.proxies, registration.heartbeat_s, registration.secret) == (
        [("127.0.0.1", 30001)],
        0.5,
        b"s3",
    )
