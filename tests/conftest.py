"""Shared test setup: Triton's interpreter on machines without a GPU, hypothesis profiles.

- Without CUDA, ``TRITON_INTERPRET=1`` is set before any test imports the
  ``triton`` backend's kernels, so they run (slowly, on tiny shapes) on the CPU
  and every test parametrized over the decoder backends checks them too. With a
  GPU they compile for it, and the CPU-device cases of that backend are skipped.

- ``ci`` (default): enough examples to catch regressions within the suite's time budget.
- ``deep``: many more examples; run by hand before a release:
  ``HYPOTHESIS_PROFILE=deep pytest tests/test_radix_stateful.py``.
"""

import os

import torch
from hypothesis import HealthCheck, settings
from mooncake_helpers import mooncake_master, mooncake_pool  # noqa: F401 (session fixtures)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
