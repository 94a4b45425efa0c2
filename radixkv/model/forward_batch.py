"""ForwardBatch: the one record that crosses from the scheduler to the model.

The scheduler works on plain ints (block ids, lengths); this is where they
become tensors. The model reads it and the KV pool; it mutates only the pool
(writing each new token's K/V at its slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ForwardBatch"]


@dataclass
class ForwardBatch:
    """One model step over a mix of prefill chunks and decode tokens.

    Sequences appear in a fixed order; ``input_ids``, ``positions`` and
    ``slot_mapping`` hold every sequence's new tokens back to back in that order.

    - ``input_ids``: ``[num_tokens]`` int64, the new tokens.
    - ``positions``: ``[num_tokens]`` int64, each new token's absolute position
      in its sequence (a sequence with ``c`` cached tokens starts at ``c``).
    - ``slot_mapping``: ``[num_tokens]`` int64, the KV pool slot
      (``block * block_size + offset``) where each new token's K/V is written.
    - ``query_lens``: new tokens per sequence (a prefill chunk, or 1 for a decode).
    - ``context_lens``: per sequence, context length after this step
      (cached + earlier chunks + new tokens); attention reads positions
      ``[0, context_len)`` through the block table.
    - ``block_tables``: per sequence, ``[>= ceil(context_len / block_size)]``
      int64 block ids: block ``i`` holds positions ``[i * bs, (i + 1) * bs)``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())
