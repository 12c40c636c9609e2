"""Engines with a MultiConnector: the store tests' ``make_llm`` (every engine drained, all its
blocks free and its connector stopped after the test)."""

from tests.engine.conftest import make_llm_at  # noqa: F401  (fixture)
from tests.kv_transfer.store.conftest import make_llm  # noqa: F401  (fixture)
