"""Triton's interpreter on machines without a GPU, for the rooms that run the decoder.

Imported by the conftest of tests/model, engine, serve and fleet. Without CUDA,
``TRITON_INTERPRET=1`` is set before any test imports the ``triton`` backend's
kernels (or starts a server that does), so they run, slowly and on tiny shapes, on
the CPU, and every test parametrized over the decoder backends checks them too.
With a GPU they compile for it, and the CPU-device cases of that backend are skipped.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
