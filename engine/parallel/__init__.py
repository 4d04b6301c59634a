"""Attention data parallel + MoE expert parallel over torch.distributed.

:class:`ParallelConfig` says how many ranks; ``Engine.from_pretrained(...,
parallel=ParallelConfig(dp=2, ep=2))`` (or ``formcast.load(..., parallel=...)``)
starts one process per rank on this machine and returns a
:class:`ParallelEngine`. Each rank owns its requests and their KV cache or
states; MoE layers exchange tokens with the ranks holding their experts
(:mod:`.moe`); the load balancer (:mod:`.placement`) replicates hot experts.
"""

from formcast.engine.parallel.config import ParallelConfig
from formcast.engine.parallel.engine import ParallelEngine
from formcast.engine.parallel.placement import (ExpertPlacement, default_placement, imbalance,
                                                plan_placement)

__all__ = ["ExpertPlacement", "ParallelConfig", "ParallelEngine", "default_placement",
           "imbalance", "plan_placement"]
