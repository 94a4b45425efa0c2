"""The fleet tier: KV cache events on the wire, prefix-aware routing across replicas, and a
fleet simulator on real traces. Torch-free (numpy, msgspec; pyzmq for the transport)."""
