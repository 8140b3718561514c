"""Markers by folder: tests/unit → unit, tests/rack → rack, tests/e2e → e2e."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        kind = Path(item.fspath).relative_to(ROOT / "tests").parts[0]
        if kind in ("unit", "rack", "e2e"):
            item.add_marker(getattr(pytest.mark, kind))


@pytest.fixture
def root_only():
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
