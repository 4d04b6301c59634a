"""DeepSeek-V4 mixture of experts: routed experts (hash or score routing) plus one
shared expert, all SwiGLU with clamped pre-activations.

Legend: ``T`` tokens, ``E`` hidden size, ``I`` expert width, ``X`` routed experts,
``K`` experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from formcast.engine.config import DeepseekV4Config
from formcast.engine.kernels.invariant_pointwise import pointwise
from formcast.engine.kernels.moe import clamped_swiglu, grouped_expert_mlp
from formcast.engine.layers.linear import Linear
from formcast.engine.models.deepseek_v4_common import dense


class Router(nn.Module):
    """Picks ``K`` experts per token and their weights.

    Scores are ``score_fn(x W^T)`` (sqrt(softplus), sigmoid or softmax). Score routing
    picks the top ``K`` of ``scores + e_score_correction_bias`` (the bias only steers
    the choice); hash routing reads the choice from ``tid2eid[token_id]``. The chosen
    scores are normalized to sum to one (when ``norm_topk_prob``) and multiplied by
    ``routed_scaling_factor``.
    """

    batch_invariant: bool = False  # (row-invariant router product; set by the runner)

    def __init__(self, config: DeepseekV4Config, *, hashed: bool) -> None:
        super().__init__()
        self.hashed = hashed
        self.top_k = config.num_experts_per_tok
        self.scoring_func = config.scoring_func
        self.normalize = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, E]``, token_ids ``[T]`` -> expert ids ``[T, K]``, weights ``[T, K]``."""
        logits = dense(x, self.weight, self.batch_invariant)
        if self.scoring_func == "sqrtsoftplus":
            scores = pointwise(F.softplus, logits, self.batch_invariant).sqrt()
        elif self.scoring_func == "sigmoid":
            scores = pointwise(torch.sigmoid, logits, self.batch_invariant)
        else:
            scores = logits.softmax(dim=-1)
        if self.hashed:
            experts = self.tid2eid[token_ids].long()
        else:
            experts = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling


class SharedExpert(nn.Module):
    """The always-on expert: a dense clamped-SwiGLU MLP."""

    batch_invariant: bool = False  # (the activation by invariant_pointwise; set by the runner)

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.limit = config.swiglu_limit
        self.gate_proj = Linear(config.hidden_size, config.moe_intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.moe_intermediate_size, bias=False)
        self.down_proj = Linear(config.moe_intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit,
                                             self.batch_invariant))


class Experts(nn.Module):
    """Routed experts stored stacked: ``gate_up_proj [X, 2I, E]`` (gate rows first),
    ``down_proj [X, E, I]``."""

    batch_invariant: bool = False  # (fixed tiles on the Triton path; set by the runner)

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.limit = config.swiglu_limit
        x, i, e = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(x, 2 * i, e))
        self.down_proj = nn.Parameter(torch.zeros(x, e, i))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x ``[T, E]``, experts/weights ``[T, K]`` -> ``[T, E]`` (grouped GEMMs in
        Triton on CUDA, a loop over the experts with tokens elsewhere)."""
        return grouped_expert_mlp(x, self.gate_up_proj, self.down_proj, experts, weights,
                                  self.limit, invariant=self.batch_invariant)


class DeepseekV4MoE(nn.Module):
    """Routed experts plus the shared expert."""

    def __init__(self, config: DeepseekV4Config, *, hashed: bool) -> None:
        super().__init__()
        self.gate = Router(config, hashed=hashed)
        self.experts = Experts(config)
        self.shared_experts = SharedExpert(config)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x ``[T, E]``, token_ids ``[T]`` -> ``[T, E]``."""
        experts, weights = self.gate(x, token_ids)
        return self.experts(x, experts, weights) + self.shared_experts(x)
