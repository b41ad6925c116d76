"""Fixtures shared by the command tests that train: one torch thread, and one straight run per module."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_loop import one_torch_thread, straight_run


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Runs compared bit for bit must use the same thread count; one is also fastest on a busy machine.
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    return straight_run(tmp_path_factory)
