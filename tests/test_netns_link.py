"""``tests/netns_link.py``: the shaped link carries TCP at no more than its rate and counts the
bytes; its addresses exist only inside its namespaces (none in the root one); it leaves nothing
behind, and what a killed owner left behind is removed by the next link. Root and iproute2 only
(skips elsewhere, except under ``PAGEDKV_REQUIRE_NETNS=1``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.netns_link import NetnsLink, remove_leftovers, require_link, tbf_burst_bytes

REPO_ROOT = Path(__file__).resolve().parents[1]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_a_link_carries_tcp_at_most_at_its_rate_counts_the_bytes_and_is_removed() -> None:
    require_link()
    rate_bit, size = 100_000_000, 4 << 20
    with NetnsLink(rate_bit) as link:
        elapsed = link.send_tcp(size)
        assert link.sent_bytes("p") >= size  # payload plus headers
        assert elapsed >= (size - tbf_burst_bytes(rate_bit)) * 8 / rate_bit
        root_addresses = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True)
        assert link.address("p") not in root_addresses.stdout  # only inside the namespaces
        made = {link.namespace("p"), link.namespace("d")}
        assert made <= _namespaces()
    assert not made & _namespaces()


def test_what_a_killed_owner_left_is_removed_and_a_live_owners_link_is_kept() -> None:
    require_link()
    crashed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal\n"
            "from tests.netns_link import NetnsLink\n"
            "link = NetnsLink(10**9).__enter__()\n"
            "print(link.namespace('p'), link.namespace('d'), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    left = set(crashed.stdout.split())
    assert len(left) == 2 and left <= _namespaces(), crashed.stderr
    with NetnsLink(10**9) as mine:
        assert not left & _namespaces()  # entering a link removed them
        assert remove_leftovers() == []
        assert {mine.namespace("p"), mine.namespace("d")} <= _namespaces()
