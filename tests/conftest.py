"""Session set-up shared by every test directory."""

from __future__ import annotations


def pytest_sessionstart(session) -> None:
    """Build (or load from the cache) the CPU decode kernel once, before any test starts an
    engine: on a clean machine the build takes about a minute, which an engine subprocess
    started with a readiness timeout must not pay."""
    from pagedkv.attention.cpu_decode_attention import load_paged_decode

    load_paged_decode()
