"""Expert-parallel routed experts over a torch.distributed group.

Each rank holds the experts of its slots (:class:`ExpertPlacement`). A step's
(token, expert) pairs travel to a rank holding a copy of their expert (all-to-all:
counts, then rows and slot ids), every rank runs its slots' MLPs on what it
received, and the results travel back (all-to-all) to be weighted and summed per
token where the token lives. A rank with no tokens still joins every exchange
with empty tensors: it may hold experts others need. Per-expert token counts are
recorded for the load balancer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from formcast.engine.kernels.moe import grouped_expert_mlp
from formcast.engine.parallel.placement import ExpertPlacement


class ExpertParallelExperts(nn.Module):
    """Drop-in for a layer's routed experts (same ``forward(x, experts, weights)``).

    Built from every expert's weights, ``full_gate_up`` [X, 2I, E] and ``full_down``
    [X, E, I] (as loaded), it keeps only the experts of this rank's slots. A new
    placement (:meth:`place`, between steps) copies the experts a rank gains from
    a rank that holds them, over the group (point to point)."""

    # batch-invariant mode (set with the model's): the activation by invariant_pointwise,
    # and a token's experts added in expert order, as on one process
    batch_invariant: bool = False

    def __init__(self, full_gate_up: torch.Tensor, full_down: torch.Tensor, limit: float,
                 placement: ExpertPlacement, group=None) -> None:
        super().__init__()
        self.limit = limit
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if placement.num_ranks != self.world:
            raise ValueError(f"placement for {placement.num_ranks} ranks, group has {self.world}")
        self.num_experts = full_gate_up.shape[0]
        self.loads = torch.zeros(self.num_experts, dtype=torch.long)  # tokens routed here
        mine = [max(e, 0) for e in placement.slots[self.rank]]  # empty slots: never routed to
        self.gate_up = full_gate_up[mine].clone()
        self.down = full_down[mine].clone()
        self._route(placement)

    def _route(self, placement: ExpertPlacement) -> None:
        self.placement = placement
        copies = [placement.copies(e) for e in range(self.num_experts)]
        width = max(len(c) for c in copies)
        self._num_copies = torch.tensor([len(c) for c in copies])
        self._copy_rank = torch.tensor([[c[j % len(c)][0] for j in range(width)] for c in copies])
        self._copy_slot = torch.tensor([[c[j % len(c)][1] for j in range(width)] for c in copies])

    def place(self, placement: ExpertPlacement) -> None:
        """Move to ``placement`` (every rank calls this together). An expert this
        rank keeps is copied locally; one it gains comes from the lowest rank that
        held it. Results do not change: every copy computes the same function."""
        old = self.placement
        held = {e: (r, s) for r in reversed(range(self.world))
                for s, e in enumerate(old.slots[r]) if e >= 0}  # lowest rank wins
        gate_up = torch.empty_like(self.gate_up)
        down = torch.empty_like(self.down)
        requests = []
        for dst in range(self.world):
            for slot, expert in enumerate(placement.slots[dst]):
                if expert < 0:
                    continue
                src, src_slot = held[expert]
                if expert in old.slots[dst]:  # already here: a local copy
                    src, src_slot = dst, old.slots[dst].index(expert)
                if dst == self.rank and src == self.rank:
                    gate_up[slot], down[slot] = self.gate_up[src_slot], self.down[src_slot]
                elif dst == self.rank:
                    requests += [dist.irecv(gate_up[slot], src, group=self.group, tag=2 * slot),
                                 dist.irecv(down[slot], src, group=self.group, tag=2 * slot + 1)]
                elif src == self.rank:  # (self.gate_up/down rows are contiguous)
                    requests += [dist.isend(self.gate_up[src_slot], dst, group=self.group,
                                            tag=2 * slot),
                                 dist.isend(self.down[src_slot], dst, group=self.group,
                                            tag=2 * slot + 1)]
        for req in requests:
            req.wait()
        self.gate_up, self.down = gate_up, down
        self._route(placement)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """x ``[T, E]``, experts/weights ``[T, K]`` (T may be 0) -> ``[T, E]``."""
        dev = x.device
        t, k = experts.shape
        flat = experts.flatten().long().cpu()
        self.loads += torch.bincount(flat, minlength=self.num_experts)
        pair = torch.arange(t * k)
        # the copy of each pair's expert: spread by pair index (and rank) over the copies
        which = (pair + self.rank) % self._num_copies[flat]
        dest = self._copy_rank[flat, which]
        slot = self._copy_slot[flat, which]
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        tokens = (order // k).to(dev)
        rows = torch.empty(sum(recv), x.shape[1], dtype=x.dtype, device=dev)
        dist.all_to_all_single(rows, x[tokens].contiguous(), recv, send, group=self.group)
        slots = torch.empty(sum(recv), dtype=torch.long)
        dist.all_to_all_single(slots, slot[order].contiguous(), recv, send, group=self.group)
        slots = slots.to(dev)
        y = grouped_expert_mlp(rows, self.gate_up, self.down, slots[:, None],
                               torch.ones(len(slots), 1, dtype=torch.float32, device=dev),
                               self.limit, invariant=self.batch_invariant)
        back = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=dev)
        dist.all_to_all_single(back, y.contiguous(), send, recv, group=self.group)
        out = torch.zeros_like(x)
        w = weights.flatten()[order.to(dev)]
        if self.batch_invariant:  # (pairs by expert, as grouped_expert_mlp adds them)
            by_expert = torch.argsort(flat[order], stable=True).to(dev)
            tokens, back, w = tokens[by_expert], back[by_expert], w[by_expert]
        out.index_add_(0, tokens, (back * w[:, None]).to(out.dtype))
        return out
