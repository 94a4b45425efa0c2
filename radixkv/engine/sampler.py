"""Sampler: each step's next tokens from the model's logits, for the whole batch at once.

One pass over the rows that pick a token this step, with tensor operations over
the batch (no Python loop over the vocabulary, and none per request but for one
random scalar per sampled row):

1. The model's log-probabilities (``log_softmax`` of the raw logits): every picked
   token's logprob and, where asked, the ``top_logprobs`` likeliest, come from them.
2. Adjustments, only on the rows that ask for one, in vLLM's order: ``logit_bias``,
   ``min_tokens`` (the stop tokens masked while too few tokens exist), then the
   repetition, frequency and presence penalties (counts of each row's output tokens,
   built by one scatter over the padded rows, and a mask of its prompt's), in float64;
   a logit they push past float32's largest is held there (an infinite one turned the
   row's probabilities to NaN, and the pick into an arbitrary token). A request's bias
   ids and values, stop ids and prompt mask become device tensors once, the first time
   it samples (kept on the request as ``Request.sampler_state``): a step concatenates
   its rows' tensors and indexes once, so its host work does not grow with the lengths
   of ``logit_bias`` or ``stop_token_ids`` (a full-vocabulary bias was rebuilt from
   Python pairs at every step: seconds per step for 16 forks).
3. Greedy rows take the argmax (ties to the lowest id): a row without adjustments
   reads exactly the logits it did before any of this existed.
4. Sampled rows, in float64: temperature, then ``min_p``, then ``top_k`` and ``top_p``
   (over the tokens sorted once, descending), then inverse-CDF sampling with one
   uniform draw from the request's own generator. A row's result depends on its own
   logits, parameters and generator only, never on the rest of the batch, so a seeded
   request repeats whatever runs beside it. Rows that truncate (top-k/top-p) and rows
   that do not are sampled as two groups, each batched.

Everything stays on the logits' device; the picks, their logprobs (and the top
logprobs, when asked) come back in one copy each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from radixkv.checks import FLOAT32_MAX
from radixkv.engine.request import Request

__all__ = ["Sampler"]


class Sampler:
    """Picks the next token of each row that samples (see the module docstring)."""

    def sample(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Request | None],
        generators: Mapping[int, torch.Generator],
    ) -> list[int | None]:
        """One token per row whose request is not None (None for the others).

        ``logits`` is ``[len(reqs), vocab]``; ``generators`` holds each sampled request's
        generator by request id. Appends each pick's logprob to its request's
        ``logprobs`` (and the likeliest to ``top_logprobs`` when
        ``params.top_logprobs`` asks). Complexity: O(rows x vocab) on the device, plus
        O(rows x vocab log vocab) for rows that truncate and O(rows x their tokens)
        for rows with penalties.
        """
        tokens: list[int | None] = [None] * len(reqs)
        rows = [k for k, r in enumerate(reqs) if r is not None]
        if not rows:
            return tokens
        logp = torch.log_softmax(logits.float(), dim=-1)
        adjusted = [k for k in rows if reqs[k].params.adjusts_logits]
        scores = logits
        if adjusted:
            scores = logits.float().clone()
            _adjust(scores, [reqs[k] for k in adjusted], adjusted)
        picks = scores.argmax(dim=-1)  # ties go to the lowest id
        sampled = [k for k in rows if not reqs[k].params.greedy]
        for group in (
            [k for k in sampled if not reqs[k].params.truncates],
            [k for k in sampled if reqs[k].params.truncates],
        ):
            if group:
                chosen = _sample_rows(scores, [reqs[k] for k in group], group, generators)
                picks[torch.tensor(group, device=picks.device)] = chosen
        chosen_lp = logp.gather(1, picks[:, None])[:, 0]
        host = torch.stack([picks.double(), chosen_lp.double()]).cpu()
        picked, lps = host[0].long().tolist(), host[1].tolist()
        ranked = [k for k in rows if reqs[k].params.top_logprobs]
        if ranked:
            most = max(reqs[k].params.top_logprobs for k in ranked)
            index = torch.tensor(ranked, device=logp.device)
            values, ids = logp[index].topk(most, dim=-1)
            values, ids = values.double().cpu().tolist(), ids.cpu().tolist()
            for j, k in enumerate(ranked):
                n = reqs[k].params.top_logprobs
                reqs[k].top_logprobs.append(list(zip(ids[j][:n], values[j][:n], strict=True)))
        for k in rows:
            tokens[k] = picked[k]
            reqs[k].logprobs.append(lps[k])
        return tokens


def _adjust(scores: torch.Tensor, reqs: Sequence[Request], rows: Sequence[int]) -> None:
    """Apply each request's logit bias, min_tokens mask and penalties to its row, in place.
    Complexity: O(rows) on the host, but for the penalties' output counts (O(rows x
    output tokens)); O(rows x vocab) on the device."""
    device, vocab = scores.device, scores.shape[1]
    states = [_state_of(r, vocab, device) for r in reqs]
    # logit_bias, added
    biased = [(k, s) for k, s in zip(rows, states, strict=True) if s.bias_ids is not None]
    if biased:
        where = _rows_and_columns([k for k, _ in biased], [s.bias_ids for _, s in biased])
        values = torch.cat([s.bias_values for _, s in biased])
        scores.index_put_(where, values, accumulate=True)
    # min_tokens: no stop token until enough tokens exist
    held = [
        (k, s)
        for r, k, s in zip(reqs, rows, states, strict=True)
        if s.stop_ids is not None and r.num_output_tokens < r.params.min_tokens
    ]
    if held:
        scores[_rows_and_columns([k for k, _ in held], [s.stop_ids for _, s in held])] = -torch.inf
    # penalties, over each row's output (and, for repetition, its prompt), in float64
    pen = [(r, k, s) for r, k, s in zip(reqs, rows, states, strict=True) if r.params.penalises]
    if pen:
        index = torch.tensor([k for _, k, _ in pen], device=device)
        f64 = torch.float64
        outputs = [r.tokens[r.prompt_len :] for r, _, _ in pen]
        counts = _token_counts(outputs, vocab, device).double()
        seen = counts > 0
        x = scores[index].double()
        params = [r.params for r, _, _ in pen]
        if any(p.repetition_penalty != 1.0 for p in params):
            rep = torch.tensor([p.repetition_penalty for p in params], dtype=f64, device=device)
            rep = rep[:, None]
            none = torch.zeros(vocab, dtype=torch.bool, device=device)
            in_prompt = torch.stack([none if s.in_prompt is None else s.in_prompt for *_, s in pen])
            x = torch.where(seen | in_prompt, torch.where(x > 0, x / rep, x * rep), x)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=f64, device=device)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=f64, device=device)
        x = x - freq[:, None] * counts - pres[:, None] * seen
        scores[index] = x.clamp(max=FLOAT32_MAX).to(scores.dtype)
    scores.clamp_(max=FLOAT32_MAX)  # a bias past float32's largest


class _RowState:
    """One request's adjustments as tensors on the logits' device: ``bias_ids`` and
    ``bias_values`` (None: no bias), ``stop_ids`` (None: min_tokens holds nothing back),
    ``in_prompt`` (``[vocab]`` bool, the prompt's tokens; None: no repetition penalty)."""

    __slots__ = ("bias_ids", "bias_values", "stop_ids", "in_prompt")

    def __init__(self, req: Request, vocab: int, device: torch.device) -> None:
        params = req.params
        ids, values = params.logit_bias_arrays
        self.bias_ids = torch.from_numpy(ids.copy()).to(device) if len(ids) else None
        self.bias_values = torch.from_numpy(values.copy()).to(device) if len(ids) else None
        self.stop_ids = None
        if params.min_tokens > 0 and params.stop_token_ids:
            self.stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.int64, device=device)
        self.in_prompt = None
        if params.repetition_penalty != 1.0:
            self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt = torch.from_numpy(req.prompt.astype(np.int64)).to(device)
            self.in_prompt[prompt] = True


def _state_of(req: Request, vocab: int, device: torch.device) -> _RowState:
    """``req``'s tensors: built the first time it samples (O(its lists and prompt)), then
    kept on it. Complexity: O(1) after."""
    state = req.sampler_state
    if not isinstance(state, _RowState):
        state = req.sampler_state = _RowState(req, vocab, device)
    return state


def _rows_and_columns(
    rows: Sequence[int], columns: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(row, column)`` index of every entry of ``columns`` (one tensor of column ids per
    row of ``rows``), built on the device: host work O(len(rows))."""
    device = columns[0].device
    sizes = [len(c) for c in columns]
    repeats = torch.tensor(sizes, device=device)
    row_ids = torch.tensor(rows, device=device)
    return row_ids.repeat_interleave(repeats, output_size=sum(sizes)), torch.cat(columns)


def _token_counts(seqs: Sequence[np.ndarray], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(seqs), vocab]`` float32 counts of each token id in each sequence (one scatter
    over the sequences padded with an extra id, dropped after)."""
    width = max((len(s) for s in seqs), default=0)
    padded = np.full((len(seqs), max(width, 1)), vocab, dtype=np.int64)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    ids = torch.from_numpy(padded).to(device)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def _sample_rows(
    scores: torch.Tensor,
    reqs: Sequence[Request],
    rows: Sequence[int],
    generators: Mapping[int, torch.Generator],
) -> torch.Tensor:
    """The sampled token of each row (a device tensor): temperature, min_p, top-k, top-p,
    then inverse-CDF sampling with one uniform from each request's generator. All rows
    truncate (top-k/top-p, over the tokens sorted descending) or none does."""
    device = scores.device
    params = [r.params for r in reqs]
    x = scores[torch.tensor(rows, device=device)].double()
    temp = torch.tensor([p.temperature for p in params], device=device, dtype=x.dtype)
    # shifted so the top logit is 0 before dividing: at a tiny temperature the rest go
    # to -inf (a one-hot), where an unshifted row overflowed to inf and softmax to NaN
    probs = torch.softmax((x - x.max(dim=-1, keepdim=True).values) / temp[:, None], dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=x.dtype)
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < floor, 0.0, probs)
    order = None
    if params[0].truncates:
        probs, order = probs.sort(dim=-1, descending=True, stable=True)
        vocab = probs.shape[1]
        top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
        position = torch.arange(vocab, device=device)[None, :]
        probs = torch.where(position < top_k[:, None], probs, 0.0)
        top_p = torch.tensor([p.top_p for p in params], device=device, dtype=x.dtype)
        before = probs.cumsum(dim=-1) - probs  # mass of the likelier tokens kept
        keep = before < top_p[:, None] * probs.sum(dim=-1, keepdim=True)  # keeps the first
        probs = torch.where(keep, probs, 0.0)
    cdf = probs.cumsum(dim=-1)
    draws = [torch.rand((), generator=generators[r.request_id], dtype=torch.float64) for r in reqs]
    u = torch.stack(draws).to(device) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None], right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)
    if order is not None:
        pick = order.gather(1, pick[:, None])[:, 0]
    return pick
