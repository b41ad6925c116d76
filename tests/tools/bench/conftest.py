"""The store benches' tests use the stores' fixture that turns syncs off (a bench measures the code, not the disk)."""

from __future__ import annotations

from tests.stores.conftest import no_syncs  # noqa: F401 (a fixture, found by name)
