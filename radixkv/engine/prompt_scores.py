"""Prompt logprobs: scored in the paged prefill, and kept with the cached blocks.

A request that asks for ``prompt_logprobs`` (an OpenAI ``echo`` + ``logprobs``
request, lm-eval's loglikelihood) needs, for each prompt position ``p >= 1``, the
logprob of token ``p`` given tokens ``[0, p)``, its rank, and the likeliest tokens
there. vLLM v1 gives up the prefix cache for such a request (it reads no cached
block), so scoring k continuations of one long context computes the context k
times. Here the scores of a full block are a function of the block's tokens and
everything before them, exactly what a cached block stands for, so they are kept
beside it and a later request reads them instead of recomputing the context:

- :class:`BlockScores` holds, per full prompt block a scoring request computed,
  each position's ``(logprob, rank, top-1 id, top-1 logprob)`` and the hidden
  state of the block's last position (from which the first position of the *next*
  block is scored: its token is not known until a request brings it). Records are
  content-addressed (a chained 128-bit hash of the block's tokens, all before them
  and the request's namespace), so a record can never describe other tokens than the
  block it is read for, however blocks are reused; there are as many rows as the pool
  has blocks, the least recently used going first.
- :data:`NO_BLOCK_SCORES` keeps nothing: a scoring request then reads no cached
  prefix and computes its whole prompt (vLLM's behaviour; the baseline of
  ``benchmarks/bench_prompt_scores.py``).
- :class:`PromptScorer` is the engine's collaborator: at admission it tells the
  scheduler how much of a scoring request's match it may read (the leading blocks
  with records, or none when the request asks for more top tokens than a record
  keeps) and copies those scores into the request; at each step it scores the
  request's new prompt positions from the model's hidden states, keeps the
  records of the blocks they complete, and hands the request its
  :class:`~radixkv.engine.request.PromptLogprobs` when its prompt is done.

Scores read from a record equal the recomputed ones within the tolerance of the
engine's other outputs (the same logits, computed in another batch shape).
Memory: ``16 * block_size + hidden_size * dtype bytes + 16`` bytes a record
(docs/engine.md gives the figure per cached token).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from radixkv.cache.hashing import BlockHasher, namespace_bytes
from radixkv.engine.request import PromptLogprobs, Request
from radixkv.engine.scheduler import ScheduledSeq, SchedulerOutput
from radixkv.errors import InvariantError

__all__ = [
    "NO_BLOCK_SCORES",
    "ScoreStore",
    "TOP_KEPT",
    "token_scores",
    "BlockScores",
    "NoBlockScores",
    "PromptScorer",
    "PromptScoring",
]

TOP_KEPT = 1
"""Likeliest tokens a record keeps per position: what ``echo`` + ``logprobs: 1`` (lm-eval's
loglikelihood requests) shows. A request asking for more reads no cached prefix."""

SCORE_ROWS_ELEMENTS = 1 << 24
"""Most logits (rows x vocabulary) one scoring product makes at once (64 MiB in float32)."""

Scores = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Per position: logprob of its token, its rank, the likeliest token and that token's logprob."""

_NAMER = BlockHasher("xxhash", hash_seed=0)  # 128-bit chained names: records' keys


def token_scores(logits: torch.Tensor, tokens: np.ndarray, width: int) -> Scores:
    """For each row of ``logits`` (``[n, vocab]``): the logprob of ``tokens[i]``, its rank (1:
    the likeliest; ties share the better rank) and the ``width`` likeliest ids and their
    logprobs (``[n, width]``), as numpy on the host. The one scoring formula, for the
    prefill's rows and :meth:`~radixkv.engine.Engine.score_prompt`'s dense reference.
    Complexity: O(n x vocab)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=logp.device)
    chosen = logp.gather(1, target[:, None])
    ranks = ((logp > chosen).sum(dim=-1) + 1).cpu().numpy()
    values, ids = logp.topk(min(width, logp.shape[-1]), dim=-1)
    return (
        chosen[:, 0].double().cpu().numpy(),
        ranks,
        ids.cpu().numpy(),
        values.double().cpu().numpy(),
    )


class ScoreStore(Protocol):
    """Where the scores of full prompt blocks are kept (or not)."""

    def lookup(self, names: Sequence[bytes]) -> list[int]:
        """Rows of the longest run of ``names`` (from the first) that have records."""
        ...

    def put(
        self,
        name: bytes,
        scores: Scores,
        hidden: torch.Tensor,
    ) -> None:
        """Keep one block's record (its positions' scores and its last position's hidden)."""
        ...

    def read(self, rows: Sequence[int]) -> Scores:
        """The records' scores, ``[len(rows) * block_size]`` each, in row order."""
        ...

    def hidden_of(self, row: int) -> torch.Tensor:
        """A copy of a record's hidden state."""
        ...


class NoBlockScores:
    """Keeps nothing; every lookup finds nothing."""

    def lookup(self, names: Sequence[bytes]) -> list[int]:
        return []

    def put(
        self,
        name: bytes,
        scores: Scores,
        hidden: torch.Tensor,
    ) -> None:
        pass

    def read(self, rows: Sequence[int]) -> Scores:
        raise InvariantError("NoBlockScores holds no record to read")

    def hidden_of(self, row: int) -> torch.Tensor:
        raise InvariantError("NoBlockScores holds no record to read")


NO_BLOCK_SCORES = NoBlockScores()


class BlockScores:
    """Up to ``num_rows`` block records, least recently used out first.

    The scores live in host arrays (they are read on the host, into responses); the
    hidden states on ``device`` in ``dtype`` (they go back through the model's head).
    Nothing is allocated until the first :meth:`put`. Complexity: O(1) a lookup
    step, a put and an eviction; O(rows x block_size) a read.
    """

    def __init__(
        self,
        num_rows: int,
        block_size: int,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.num_rows, self.block_size, self.hidden_size = num_rows, block_size, hidden_size
        self.device, self.dtype = device, dtype
        self._rows: OrderedDict[bytes, int] = OrderedDict()
        self._free: list[int] = []
        self._arrays: Scores | None = None
        self._hidden: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def bytes_per_record(self) -> int:
        """Bytes one record takes: four 4-byte scores per position, the hidden state, the
        16-byte key (the index's own overhead aside)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 16 * self.block_size + self.hidden_size * elem + 16

    def lookup(self, names: Sequence[bytes]) -> list[int]:
        rows: list[int] = []
        index = self._rows
        for name in names:
            row = index.get(name)
            if row is None:
                break
            index.move_to_end(name)
            rows.append(row)
        return rows

    def put(
        self,
        name: bytes,
        scores: Scores,
        hidden: torch.Tensor,
    ) -> None:
        index = self._rows
        row = index.get(name)
        if row is not None:  # the same tokens scored again: the record stands
            index.move_to_end(name)
            return
        arrays, hidden_rows = self._allocated()
        if self._free:
            row = self._free.pop()
        elif len(index) < self.num_rows:
            row = len(index)
        else:
            _, row = index.popitem(last=False)
        for dst, src in zip(arrays, scores, strict=True):
            dst[row] = src
        hidden_rows[row] = hidden
        index[name] = row

    def read(self, rows: Sequence[int]) -> Scores:
        arrays, _ = self._allocated()
        picked = np.asarray(rows, dtype=np.int64)
        logprobs, ranks, top_ids, top_lps = (a[picked].reshape(-1) for a in arrays)
        return logprobs, ranks, top_ids, top_lps

    def hidden_of(self, row: int) -> torch.Tensor:
        _, hidden_rows = self._allocated()
        return hidden_rows[row].clone()

    def _allocated(
        self,
    ) -> tuple[Scores, torch.Tensor]:
        if self._arrays is None or self._hidden is None:
            shape = (self.num_rows, self.block_size)
            self._arrays = (
                np.zeros(shape, np.float32),
                np.zeros(shape, np.int32),
                np.zeros(shape, np.int32),
                np.zeros(shape, np.float32),
            )
            self._hidden = torch.zeros(
                self.num_rows, self.hidden_size, device=self.device, dtype=self.dtype
            )
        return self._arrays, self._hidden


class PromptScoring:
    """One request's prompt scores as they arrive (position ``p`` in ``[1, prompt_len)``).

    ``top``: the likeliest tokens the request asks for at each position (its
    ``prompt_logprobs``); at least :data:`TOP_KEPT` are computed, for the records.
    ``boundary``: the hidden state that scores position ``boundary_at`` (the first one
    after a prefix read from records), until a step uses it.
    """

    def __init__(
        self, prompt: np.ndarray, top: int, block_size: int, namespace: Hashable = None
    ) -> None:
        n = len(prompt)
        width = max(top, TOP_KEPT)
        self.prompt, self.top, self.block_size = prompt, top, block_size
        self.namespace = namespace
        self.logprobs = np.zeros(n, np.float64)
        self.ranks = np.zeros(n, np.int64)
        self.top_ids = np.zeros((n, width), np.int64)
        self.top_lps = np.zeros((n, width), np.float64)
        self.known = np.zeros(n, bool)
        self.known[:1] = True  # the first token has no score
        self.boundary: torch.Tensor | None = None
        self.boundary_at = -1
        self._names: list[bytes] | None = None

    @property
    def complete(self) -> bool:
        return bool(self.known.all())

    def names(self) -> list[bytes]:
        """The record keys of the prompt's full blocks (computed once). The namespace is in
        them: a tenant reads only records its own requests left, so how fast its scoring
        runs says nothing of another tenant's prompts."""
        if self._names is None:
            data = np.ascontiguousarray(self.prompt, dtype=np.int32).tobytes()
            extra = namespace_bytes(self.namespace)
            self._names = _NAMER.chain(data, 4 * self.block_size, extra)
        return self._names

    def fill(self, scores: Scores) -> None:
        """Positions ``[1, len)`` from records of the prompt's first blocks."""
        logprobs, ranks, top_ids, top_lps = scores
        n = len(logprobs)
        self.logprobs[1:n] = logprobs[1:]
        self.ranks[1:n] = ranks[1:]
        self.top_ids[1:n, 0] = top_ids[1:]
        self.top_lps[1:n, 0] = top_lps[1:]
        self.known[1:n] = True

    def result(self) -> PromptLogprobs:
        """The request's :class:`PromptLogprobs`; ``InvariantError`` if a position is unscored."""
        if not self.complete:
            missing = np.flatnonzero(~self.known)[:5].tolist()
            raise InvariantError(f"prompt positions {missing} were never scored")
        k = self.top
        tops = [
            list(zip(ids, lps, strict=True))
            for ids, lps in zip(
                self.top_ids[1:, :k].tolist(), self.top_lps[1:, :k].tolist(), strict=True
            )
        ]
        return PromptLogprobs(self.logprobs[1:].tolist(), self.ranks[1:].tolist(), tops)


@dataclass
class _Segment:
    """Positions ``[first, first + count)`` of one request's prompt, scored by ``count``
    consecutive vectors of a step."""

    scoring: PromptScoring
    first: int
    count: int


@dataclass
class _StepPlan:
    """What one step scores: hidden ``rows`` of the batch for ``row_segments``, kept
    ``boundaries`` for ``boundary_segments`` (in that order: the vectors' order), and the
    blocks whose records it completes (``(scoring, block, hidden row)``)."""

    rows: list[int] = field(default_factory=list)
    row_segments: list[_Segment] = field(default_factory=list)
    boundaries: list[torch.Tensor] = field(default_factory=list)
    boundary_segments: list[_Segment] = field(default_factory=list)
    block_ends: list[tuple[PromptScoring, int, int]] = field(default_factory=list)


class PromptScorer:
    """Scores prompts in the engine's paged prefill; reads and keeps block records in ``store``.

    ``model`` has ``logits(hidden)`` (:meth:`radixkv.model.Decoder.logits`). The
    scheduler asks :meth:`usable_blocks` at each lookup (it is the scheduler's
    :class:`~radixkv.engine.scheduler.PrefixReader`); the engine asks :meth:`scores`
    whether a step needs the model's hidden states, then hands them to :meth:`score`.
    """

    def __init__(self, model: torch.nn.Module, block_size: int, store: ScoreStore) -> None:
        self.model, self.block_size, self.store = model, block_size, store
        self.num_read_positions = 0
        """Prompt positions whose scores came from records, not from the model."""

    # ------------------------------------------------------- admission
    def usable_blocks(self, request: Request, num_blocks: int) -> int:
        """All ``num_blocks`` for a request that scores nothing (or has scored its prompt);
        else the leading blocks with records, whose scores it takes now."""
        top = request.params.prompt_logprobs
        if top is None:
            return num_blocks
        scoring = self._scoring_of(request, top)
        if scoring.complete or num_blocks == 0:
            return num_blocks
        scoring.boundary = None  # an earlier admission's (preempted since): this one decides
        if top > TOP_KEPT:
            return 0
        rows = self.store.lookup(scoring.names()[:num_blocks])
        if not rows:
            return 0
        bs = self.block_size
        scoring.fill(self.store.read(rows))
        scoring.boundary = self.store.hidden_of(rows[-1])
        scoring.boundary_at = len(rows) * bs
        self.num_read_positions += len(rows) * bs - 1
        return len(rows)

    def _scoring_of(self, request: Request, top: int) -> PromptScoring:
        scoring = request.prompt_scoring
        if not isinstance(scoring, PromptScoring):
            scoring = PromptScoring(request.prompt, top, self.block_size, request.namespace)
            request.prompt_scoring = scoring
        return scoring

    # ------------------------------------------------------------ steps
    def scores(self, out: SchedulerOutput) -> bool:
        """True if a request of ``out`` has prompt positions to score this step."""
        return any(_scores_prompt(seq) for seq in out.seqs)

    @torch.no_grad()
    def score(self, out: SchedulerOutput, hidden: torch.Tensor) -> torch.Tensor:
        """Score the step's new prompt positions from ``hidden`` (the runner's
        ``[out.num_tokens, hidden_size]``), keep the records of the blocks they complete,
        hand finished prompts their :class:`PromptLogprobs`; return the last tokens'
        logits (``[len(out.seqs), vocab]``, float32) for sampling.

        Complexity: one head product per scored position, in slices of
        :data:`SCORE_ROWS_ELEMENTS` logits.
        """
        plan = _StepPlan()
        last_rows: list[int] = []
        offset = 0
        for seq in out.seqs:
            req, start = seq.request, seq.start
            last_rows.append(offset + seq.num_new_tokens - 1)
            if _scores_prompt(seq):
                scoring = self._scoring_of(req, req.params.prompt_logprobs or 0)
                self._plan(scoring, start, seq.stop, offset, plan)
            offset += seq.num_new_tokens
        device = hidden.device
        last = self.model.logits(hidden.index_select(0, _index(last_rows, device)))
        vectors = hidden.index_select(0, _index(plan.rows, device))
        if plan.boundaries:
            vectors = torch.cat([vectors, torch.stack(plan.boundaries).to(vectors.dtype)])
        segments = plan.row_segments + plan.boundary_segments  # the order of ``vectors``
        if segments:
            self._score_segments(vectors, segments)
        for scoring, block, row in plan.block_ends:
            self._keep(scoring, block, hidden[row])
        for seq in out.seqs:
            req = seq.request
            scoring = req.prompt_scoring
            if isinstance(scoring, PromptScoring) and req.prompt_logprobs is None:
                if seq.stop >= req.prompt_len:
                    req.prompt_logprobs = scoring.result()
        return last

    def _plan(
        self, scoring: PromptScoring, start: int, stop: int, offset: int, plan: _StepPlan
    ) -> None:
        """Add to ``plan`` what one sequence's chunk ``[start, stop)`` (batch rows from
        ``offset``) scores and keeps.

        Row of position ``p`` scores position ``p + 1`` (a prompt token); a boundary left
        by :meth:`usable_blocks` scores position ``start``; a prompt block whose last
        position is in the chunk leaves that position's hidden state for its record.
        """
        n = len(scoring.prompt)
        end = min(stop, n - 1)
        if end > start:
            plan.rows.extend(range(offset, offset + end - start))
            plan.row_segments.append(_Segment(scoring, start + 1, end - start))
        if scoring.boundary is not None and scoring.boundary_at == start:
            plan.boundaries.append(scoring.boundary)
            plan.boundary_segments.append(_Segment(scoring, start, 1))
            scoring.boundary = None
        if self.store is NO_BLOCK_SCORES:
            return
        bs = self.block_size
        for block in range(start // bs, min(stop, n) // bs):
            last = (block + 1) * bs - 1
            if last >= start:
                plan.block_ends.append((scoring, block, offset + last - start))

    def _score_segments(self, vectors: torch.Tensor, segments: list[_Segment]) -> None:
        """Logprob, rank and the likeliest tokens of each segment's positions, from their
        hidden ``vectors`` (one a position, in segment order)."""
        tokens = np.concatenate(
            [seg.scoring.prompt[seg.first : seg.first + seg.count] for seg in segments]
        )
        width = max(seg.scoring.top_ids.shape[1] for seg in segments)
        step = max(1, SCORE_ROWS_ELEMENTS // self.model.config.vocab_size)
        parts = [
            token_scores(self.model.logits(vectors[lo : lo + step]), tokens[lo : lo + step], width)
            for lo in range(0, len(tokens), step)
        ]
        chosen_lps, ranks, top_ids, top_lps = (np.concatenate(p) for p in zip(*parts, strict=True))
        at = 0
        for seg in segments:
            s, here = seg.scoring, slice(seg.first, seg.first + seg.count)
            mine = slice(at, at + seg.count)
            k = s.top_ids.shape[1]
            s.logprobs[here], s.ranks[here] = chosen_lps[mine], ranks[mine]
            s.top_ids[here], s.top_lps[here] = top_ids[mine, :k], top_lps[mine, :k]
            s.known[here] = True
            at += seg.count

    def _keep(self, scoring: PromptScoring, block: int, hidden: torch.Tensor) -> None:
        """Keep block ``block`` of the request's prompt, all of whose positions are scored."""
        bs = self.block_size
        lo, hi = block * bs, (block + 1) * bs
        if not scoring.known[lo:hi].all():
            raise InvariantError(f"block {block} of a prompt is kept before it is scored")
        scores = (
            scoring.logprobs[lo:hi].astype(np.float32),
            scoring.ranks[lo:hi].astype(np.int32),
            scoring.top_ids[lo:hi, 0].astype(np.int32),
            scoring.top_lps[lo:hi, 0].astype(np.float32),
        )
        self.store.put(scoring.names()[block], scores, hidden)


def _scores_prompt(seq: ScheduledSeq) -> bool:
    """Whether ``seq`` has prompt positions to score: its request asks for prompt logprobs,
    has none yet, and the chunk starts inside the prompt."""
    req = seq.request
    return (
        req.params.prompt_logprobs is not None
        and req.prompt_logprobs is None
        and seq.start < req.prompt_len
    )


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)
