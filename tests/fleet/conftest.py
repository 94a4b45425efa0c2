"""The fleet room runs the decoder: Triton's interpreter without a GPU (triton_setup.py).

A test that uses test_serve_fleet.py's ``fleet`` fixture (a Ray cluster with two fleets,
~40 s to start) is marked ``slow``, as the Ray tests of test_fleet_shutdown.py are.
"""

import pytest
import triton_setup  # noqa: F401 (sets TRITON_INTERPRET before any kernel is imported)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "fleet" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
