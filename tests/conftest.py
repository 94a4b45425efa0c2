"""Shared test setup: hypothesis profiles.

- ``ci`` (default): enough examples to catch regressions within the suite's time budget.
- ``deep``: many more examples; run by hand before a release:
  ``HYPOTHESIS_PROFILE=deep pytest tests/test_radix_stateful.py``.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=100,
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
