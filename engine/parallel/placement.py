"""Where the routed experts of one MoE layer live, and the load balancer's planner.

Every rank holds ``slots_per_rank`` expert slots. The default placement gives each
expert one slot, contiguously (rank 0 the first experts), and leaves the spare
slots empty. The planner (EPLB) fills the spare slots with replicas of the hottest
experts, splits each expert's measured load evenly over its copies, and packs
the copies onto ranks heaviest first, each onto the least loaded rank that has a
free slot and no copy of that expert yet.

A token's pair (token, expert) goes to one copy of the expert, chosen by the
pair's index, so the copies of an expert share its tokens evenly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlacement:
    """``slots[r][s]``: the expert held in slot ``s`` of rank ``r`` (-1: empty)."""

    slots: tuple[tuple[int, ...], ...]
    num_experts: int

    def __post_init__(self) -> None:
        held = {e for rank in self.slots for e in rank if e >= 0}
        if held != set(range(self.num_experts)):
            missing = sorted(set(range(self.num_experts)) - held)
            raise ValueError(f"expert placement leaves experts {missing} on no rank")
        if len({len(rank) for rank in self.slots}) != 1:
            raise ValueError("expert placement: every rank needs the same number of slots")
        for r, rank in enumerate(self.slots):
            used = [e for e in rank if e >= 0]
            if len(used) != len(set(used)):
                raise ValueError(f"expert placement: rank {r} holds an expert twice")

    @property
    def num_ranks(self) -> int:
        return len(self.slots)

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots[0])

    def copies(self, expert: int) -> list[tuple[int, int]]:
        """(rank, slot) of every copy of ``expert``, in rank order."""
        return [(r, s) for r, rank in enumerate(self.slots) for s, e in enumerate(rank)
                if e == expert]

    def rank_loads(self, expert_loads: list[float]) -> list[float]:
        """Each rank's load when every expert's load is split evenly over its copies."""
        share = {e: expert_loads[e] / len(self.copies(e)) for e in range(self.num_experts)}
        return [sum(share[e] for e in rank if e >= 0) for rank in self.slots]


def default_placement(num_experts: int, num_ranks: int, spare_slots: int = 0) -> ExpertPlacement:
    """One copy of each expert, contiguous by rank, and ``spare_slots`` empty slots a rank."""
    per_rank = math.ceil(num_experts / num_ranks)
    slots = []
    for r in range(num_ranks):
        mine = [e for e in range(r * per_rank, (r + 1) * per_rank) if e < num_experts]
        slots.append(tuple(mine + [-1] * (per_rank + spare_slots - len(mine))))
    return ExpertPlacement(tuple(slots), num_experts)


def imbalance(placement: ExpertPlacement, expert_loads: list[float]) -> float:
    """max / mean rank load (1.0 is perfect balance)."""
    loads = placement.rank_loads(expert_loads)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def plan_placement(expert_loads: list[float], num_ranks: int, slots_per_rank: int
                   ) -> ExpertPlacement:
    """A placement for the measured ``expert_loads`` (tokens routed to each expert)
    using every slot: replicas for the hottest experts, copies packed onto ranks
    to balance their load."""
    num_experts = len(expert_loads)
    total_slots = num_ranks * slots_per_rank
    if total_slots < num_experts:
        raise ValueError(f"{num_experts} experts do not fit in {num_ranks} ranks x "
                         f"{slots_per_rank} slots")
    # copies per expert: one each, then every spare slot to whichever expert has
    # the largest load per copy (never more copies than ranks)
    copies = [1] * num_experts
    for _ in range(total_slots - num_experts):
        candidates = [e for e in range(num_experts) if copies[e] < num_ranks]
        if not candidates:
            break
        hottest = max(candidates, key=lambda e: (expert_loads[e] / copies[e], -e))
        copies[hottest] += 1
    items = sorted(((expert_loads[e] / copies[e], e) for e in range(num_experts)
                    for _ in range(copies[e])), key=lambda it: (-it[0], it[1]))
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    load = [0.0] * num_ranks
    for share, expert in items:
        options = [r for r in range(num_ranks)
                   if len(ranks[r]) < slots_per_rank and expert not in ranks[r]]
        if not options:  # only ranks that hold it already have room: one copy fewer
            continue
        r = min(options, key=lambda r: (load[r], len(ranks[r]), r))
        ranks[r].append(expert)
        load[r] += share
    slots = tuple(tuple(sorted(rank)) + (-1,) * (slots_per_rank - len(rank)) for rank in ranks)
    return ExpertPlacement(slots, num_experts)
