"""How an engine spreads over processes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Attention data parallel over ``dp`` ranks, MoE expert parallel over ``ep``.

    Parameters
    ----------
    dp : int
        Ranks (processes); each owns its own requests and KV cache/states, and
        runs the attention of its requests only.
    ep : int
        1: every rank holds every expert (plain data parallel). ``dp``: the routed
        experts are split over the ranks, tokens travel to their experts (MoE
        models; dense models ignore it).
    spare_expert_slots : int
        Extra expert slots a rank holds for replicas of hot experts (the load
        balancer fills them; empty until it runs).
    backend : str
        torch.distributed backend: "auto" (gloo on the CPU, NCCL on CUDA), "gloo"
        or "nccl".
    timeout_s : float
        How long the caller waits for a step of a silent worker before it gives up
        (a dead worker is noticed at once).
    """

    dp: int = 1
    ep: int = 1
    spare_expert_slots: int = 1
    backend: str = "auto"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"dp must be a positive int, got {self.dp!r}")
        if self.ep not in (1, self.dp):
            raise ValueError(f"ep must be 1 or equal to dp ({self.dp}), got {self.ep!r}")
        if self.spare_expert_slots < 0:
            raise ValueError(f"spare_expert_slots must be >= 0, got {self.spare_expert_slots}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")
