"""The expert load balancer's planner on skewed synthetic loads."""

from __future__ import annotations

import pytest
import torch

from formcast.engine.parallel.placement import (ExpertPlacement, default_placement, imbalance,
                                                plan_placement)


@pytest.mark.parametrize("experts, ranks, spare, skew", [
    (16, 4, 1, 1.2), (64, 8, 2, 1.0), (5, 2, 1, 1.5), (32, 4, 2, 0.8)])
def test_planner_brings_rank_load_within_ten_percent(experts, ranks, spare, skew):
    """Zipf-like loads: hot experts on the first ranks of the default placement
    make it badly unbalanced; the plan (replicas in the spare slots) is within 10%
    of perfect balance."""
    gen = torch.Generator().manual_seed(experts)
    order = torch.randperm(experts, generator=gen).tolist()
    loads = [0.0] * experts
    for rank, e in enumerate(order):
        loads[e] = 10000.0 / (rank + 1) ** skew
    # the hottest experts sit together on rank 0 in the unbalanced layout
    hot_first = sorted(range(experts), key=lambda e: -loads[e])
    base = default_placement(experts, ranks, spare)
    unbalanced = ExpertPlacement(tuple(tuple(hot_first[e] if e >= 0 else -1 for e in rank)
                                       for rank in base.slots), experts)
    plan = plan_placement(loads, ranks, base.slots_per_rank)
    before, after = imbalance(unbalanced, loads), imbalance(plan, loads)
    print(f"\n{experts} experts on {ranks} ranks x {base.slots_per_rank} slots, skew {skew}: "
          f"max/mean rank load {before:.2f} -> {after:.3f}")
    assert before > 1.5 and after <= 1.1
    assert plan.slots_per_rank == base.slots_per_rank
    assert sum(e >= 0 for rank in plan.slots for e in rank) == ranks * base.slots_per_rank


def test_placements_are_checked():
    assert default_placement(5, 2, 1).slots == ((0, 1, 2, -1), (3, 4, -1, -1))
    with pytest.raises(ValueError, match=r"experts \[4\]"):
        ExpertPlacement(((0, 1), (2, 3)), 5)
    with pytest.raises(ValueError, match="twice"):
        ExpertPlacement(((0, 0, 1), (2, 3, 4)), 5)
    with pytest.raises(ValueError, match="do not fit"):
        plan_placement([1.0] * 9, 2, 4)
