"""How long a replica takes to serve a request: the one cost model the simulator runs and the
prefix-aware routers score with.

:class:`ServiceModel` holds the per-token costs (real tokens, seconds);
:class:`BatchConfig` says how a batched replica shares a step (a token budget
split between decode tokens and chunked prefill, as continuous-batching
engines do). :data:`SERVICE_PROFILES` names the two calibrations, each with
where its figures come from: ``"cpu"`` (SmolLM2-135M on this repo's CPU, one
request at a time) and ``"h200"`` (radixkv's engine on an NVIDIA H200).
Plain Python arithmetic, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.checks import check_int, check_number

__all__ = ["SERVICE_PROFILES", "BatchConfig", "ServiceModel", "service_model"]

_FIELDS = ("prefill_per_token", "attention_per_key", "decode_per_token", "step_overhead")


@dataclass(frozen=True)
class ServiceModel:
    """Seconds a replica spends on a request, from its token counts (real tokens).

    - prefill of a prompt of ``P`` tokens whose first ``h`` are cached:
      ``a * u + b * keys`` with ``u = P - h`` computed tokens and
      ``keys = sum_{p=h}^{P-1} (p + 1) = u * (P + h + 1) / 2`` the keys they
      attend over (each computed token times its context);
    - one decode step of ``d`` sequences: ``step_overhead + c * d`` (so served
      alone, ``n`` output tokens take ``n * (step_overhead + c)``);
    - a batched step adds its prefill chunk's ``a * tokens + b * keys``.

    ``a`` = ``prefill_per_token``, ``b`` = ``attention_per_key``, ``c`` =
    ``decode_per_token``. The defaults are the ``"cpu"`` calibration (see
    :data:`SERVICE_PROFILES` for both and their sources). ``ValueError``
    naming the field for a negative or non-finite figure.
    """

    prefill_per_token: float = 3.40e-3
    attention_per_key: float = 1.11e-6
    decode_per_token: float = 3.40e-3
    step_overhead: float = 0.0

    def __post_init__(self) -> None:
        for name in _FIELDS:
            check_number(name, getattr(self, name), low=0)

    @staticmethod
    def keys(prompt_tokens: float, hit_tokens: float) -> float:
        """Keys attended by prefilling ``prompt_tokens`` after the first ``hit_tokens``."""
        u = prompt_tokens - hit_tokens
        return u * (prompt_tokens + hit_tokens + 1) / 2.0 if u > 0 else 0.0

    def prefill(self, prompt_tokens: float, hit_tokens: float) -> float:
        """Seconds to prefill ``prompt_tokens`` of which the first ``hit_tokens`` are cached.

        Complexity: O(1).
        """
        u = prompt_tokens - hit_tokens
        if u <= 0:
            return 0.0
        keys = u * (prompt_tokens + hit_tokens + 1) / 2.0
        return self.prefill_per_token * u + self.attention_per_key * keys

    def decode(self, output_tokens: int) -> float:
        """Seconds to decode ``output_tokens`` tokens served alone (one step each)."""
        return (self.step_overhead + self.decode_per_token) * output_tokens

    def replace(self, **changes: float | None) -> ServiceModel:
        """A copy with the given fields changed (None leaves a field as it is)."""
        fields = {name: getattr(self, name) for name in _FIELDS}
        fields.update({k: v for k, v in changes.items() if v is not None})
        return ServiceModel(**fields)


@dataclass(frozen=True)
class BatchConfig:
    """A batched replica's step: at most ``token_budget`` tokens, shared by one decode token per
    running sequence and then prefill chunks (first come, first served), for at most
    ``max_num_seqs`` sequences admitted at once.

    The defaults are vLLM's: ``max_num_batched_tokens`` 2048 with chunked
    prefill, ``max_num_seqs`` 256. ``token_budget`` must exceed
    ``max_num_seqs`` so prefill always gets some of a step. ``ValueError``
    naming the field otherwise.
    """

    token_budget: int = 2048
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_num_seqs"):
            check_int(name, getattr(self, name), low=1)
        if self.token_budget <= self.max_num_seqs:
            raise ValueError(
                f"token_budget must exceed max_num_seqs ({self.max_num_seqs}), "
                f"got {self.token_budget}"
            )

    def work(self, service: ServiceModel, prompt: int, hit: int, output: int) -> float:
        """A request's share of a saturated replica's time: its prefill, its decode tokens, and
        ``step_overhead`` per ``token_budget`` tokens it puts through a step. Summed over a
        replica's requests and divided by the time, this is its utilisation (1: saturated)."""
        tokens = max(prompt - hit, 0) + output
        return (
            service.prefill(prompt, hit)
            + service.decode_per_token * output
            + service.step_overhead * tokens / self.token_budget
        )


# The "cpu" figures: SmolLM2-135M on this repo's CPU, 1 thread,
# benchmarks/results/bench_engine_smollm2.csv (docs/engine.md): cache off, 96 requests
# computing 64,887 prompt tokens + 1,536 decode tokens took 251.6 s for 15,693.7 GFLOP as
# bench_engine.model_flops counts them: 16.0 ps/FLOP. model_flops charges 212.3 MFLOP of
# linear layers per token and 69,120 FLOP per (token, key) of attention: 3.40 ms per
# computed token, 1.11 us per key; a decode token costs one token's linear layers (3.40 ms).
# Cross-check: the cached run (8,231 computed tokens) is predicted at 39.7 s, measured 47.3 s.
#
# The "h200" figures: radixkv's engine on one NVIDIA H200, 2026-11-27 (docs/engine.md,
# "Paged kernels and CUDA graphs (H200)"; benchmarks/results/h200/), SmolLM2-135M's shape.
# - prefill_per_token 50 us: the engine table's fp32 triton + CUDA graphs runs
#   (run2_engine_smollm2shape_triton.csv): cache off computed 40,274 prompt tokens in
#   2.168 s wall, radix 5,394 in 0.421 s, the same decode work in both, so
#   (2.168 - 0.421) / (40,274 - 5,394) = 50.1 us per computed token (its ~630-token
#   prompts' attention included, about 1 us of it).
# - attention_per_key 3.0 ns: the fp32 paged prefill kernel, 0.215 ms per layer for
#   4 x 1,024 tokens (2.1 M keys) and 0.397 ms for 2 x 2,048 (4.2 M keys), x 30 layers:
#   3.07 and 2.84 ns per key.
# - step_overhead 1.79 ms + decode_per_token 2 us per sequence: the bf16 decode step with
#   triton + CUDA graphs, 1.85 ms for 32 sequences (1.72 ms for 8, 1.83 ms for 64: the
#   step is launch-bound, nearly flat in the batch); 1.79 + 32 x 0.002 = 1.85 ms.
# The prefill figures are fp32 and the decode step bf16 (the only engine-level prefill
# measurement is fp32): a bf16 engine would prefill faster than this profile says.
SERVICE_PROFILES: dict[str, ServiceModel] = {
    "cpu": ServiceModel(),
    "h200": ServiceModel(
        prefill_per_token=50.0e-6,
        attention_per_key=3.0e-9,
        decode_per_token=2.0e-6,
        step_overhead=1.79e-3,
    ),
}


def service_model(service: ServiceModel | str) -> ServiceModel:
    """``service`` itself, or the profile it names in :data:`SERVICE_PROFILES`.

    ``ValueError`` naming ``service`` for an unknown name or another type.
    """
    if isinstance(service, ServiceModel):
        return service
    if isinstance(service, str) and service in SERVICE_PROFILES:
        return SERVICE_PROFILES[service]
    raise ValueError(
        f"service must be a ServiceModel or one of {sorted(SERVICE_PROFILES)}, got {service!r}"
    )
