"""The engine room runs the decoder: Triton's interpreter without a GPU (triton_setup.py)."""

import triton_setup  # noqa: F401 (sets TRITON_INTERPRET before any kernel is imported)
