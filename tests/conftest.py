"""Shared test setup, torch-free: hypothesis profiles and the Mooncake Store fixtures.

Tests live in a folder per room of the package (``tests/cache``, ``model``, ``engine``,
``serve``, ``fleet``, ``replay``, ``text``); whole-project checks (layout, README, docs,
public API, CLI) stay here. The rooms that run the decoder (model, engine, serve, fleet)
set up Triton's interpreter in their own conftest (``triton_setup.py``); the cache,
replay and text rooms run where torch is not installed (``test_torch_free.py`` collects
them with torch blocked).

- ``ci`` (default): enough examples to catch regressions within the suite's time budget.
- ``deep``: many more examples; run by hand before a release:
  ``HYPOTHESIS_PROFILE=deep pytest tests/cache/test_radix_stateful.py``.
"""

import os

from hypothesis import HealthCheck, settings
from mooncake_helpers import mooncake_master, mooncake_pool  # noqa: F401 (session fixtures)

settings.register_profile(
    "ci",
    max_examples=50,  # not derandomized: each CI run draws new examples
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "deep",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
