"""The fleet tier: KV cache events on the wire, prefix-aware routing across replicas, and a
fleet simulator on real traces. Torch-free (numpy, msgspec; pyzmq for the transport).

The simulator is :mod:`radixkv.fleet.sim`; what a run measured, :class:`SimResult`, and its
roll-up live in :mod:`radixkv.fleet.results`.
"""

from radixkv.fleet.results import SimResult

__all__ = ["SimResult"]
