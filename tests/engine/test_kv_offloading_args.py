"""``--kv-offloading-size`` / ``--kv-offloading-backend`` (vLLM's flags): the connector config
the engine runs, alone or composed with ``--kv-transfer-config`` under a MultiConnector."""

from __future__ import annotations

import argparse

import pytest

from pagedkv.engine.engine_args import EngineArgs
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_transfer.multi.config import child_configs

P2P = {"kv_connector": "P2pConnector", "kv_role": "kv_consumer", "kv_port": 15000}
OFFLOADING = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"tiers": [{"medium": "cpu", "size_gib": 2.5}]},
}


def test_without_either_flag_no_connector_runs() -> None:
    assert EngineArgs().effective_kv_transfer_config() is None
    assert EngineArgs(kv_transfer_config=P2P).effective_kv_transfer_config() == P2P


def test_the_offloading_size_alone_is_an_offloading_connector_with_a_host_tier() -> None:
    assert EngineArgs(kv_offloading_size=2.5).effective_kv_transfer_config() == OFFLOADING


def test_both_compose_under_a_multi_connector_the_tiers_first() -> None:
    args = EngineArgs(kv_transfer_config={**P2P, "engine_id": "D-0"}, kv_offloading_size=2.5)
    config = KVTransferConfig.from_dict(args.effective_kv_transfer_config())
    assert (config.kv_connector, config.kv_role, config.engine_id) == (
        "MultiConnector",
        "kv_consumer",
        "D-0",
    )
    offloading, p2p = child_configs(config)
    assert (p2p.kv_connector, p2p.kv_role, p2p.kv_port, p2p.engine_id) == (
        "P2pConnector",
        "kv_consumer",
        15000,
        "D-0",
    )
    assert (offloading.kv_connector, offloading.kv_role, offloading.engine_id) == (
        "OffloadingConnector",
        "kv_both",
        "D-0",
    )
    assert offloading.kv_connector_extra_config == OFFLOADING["kv_connector_extra_config"]


def test_a_users_multi_connector_gets_the_offloading_connector_as_its_first_child() -> None:
    user = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [P2P]},
    }
    config = EngineArgs(kv_transfer_config=user, kv_offloading_size=2.5)
    effective = config.effective_kv_transfer_config()
    assert effective["kv_connector_extra_config"]["connectors"] == [OFFLOADING, P2P]
    assert user["kv_connector_extra_config"]["connectors"] == [P2P]  # left as it was


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_offloading_size": 0}, "kv_offloading_size must be a number of GiB > 0"),
        ({"kv_offloading_size": -1.0}, "kv_offloading_size must be a number of GiB > 0"),
        ({"kv_offloading_size": "4"}, "kv_offloading_size must be a number of GiB > 0"),
        ({"kv_offloading_size": True}, "kv_offloading_size must be a number of GiB > 0"),
        ({"kv_offloading_backend": "lmcache"}, "kv_offloading_backend must be native"),
    ],
)
def test_bad_offloading_values_are_refused_by_name(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    EngineArgs.add_cli_args(parser)
    return parser


def test_the_flags_set_the_fields() -> None:
    args = parser().parse_args(["--kv-offloading-size", "0.5", "--kv-offloading-backend", "native"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.kv_offloading_size, engine_args.kv_offloading_backend) == (0.5, "native")
    assert EngineArgs.from_cli_args(parser().parse_args([])).kv_offloading_size is None


def test_an_unknown_backend_is_refused_by_the_parser() -> None:
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parser().parse_args(["--kv-offloading-backend", "lmcache"])
