"""Weight-only quantized linear layers for the CPU (int4 groups of 32, int8 per channel).

They run on torch's packed CPU kernels with bfloat16 activations, reading 4 or 8
bits per weight instead of 32: decode on a CPU is bound by reading weights, so
this is where CPU speed comes from. Int4 uses an asymmetric min/max code per group
of 32 inputs, the same layout as GGUF's Q4_1 blocks, so a Q4_1 file's own 4-bit
values come back exactly (up to the bf16 rounding of the scales).
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_SIZE = 32
QUANTIZATIONS = ("int4", "int8")


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[O, I] float -> (codes int32 [O, I] in 0..15, scales_and_zeros float32 [I/g, O, 2]).

    Dequantized value = (code - 8) * scale + zero, as torch's int4 kernels define it.
    """
    out_f, in_f = weight.shape
    w = weight.float().view(out_f, in_f // group_size, group_size)
    lo = w.amin(dim=-1, keepdim=True)
    hi = w.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    codes = torch.round((w - lo) / scale).clamp_(0, 15).to(torch.int32).view(out_f, in_f)
    zero = lo + 8 * scale
    sz = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [I/g, O, 2]
    return codes, sz


def int4_supported(linear: nn.Linear) -> bool:
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % 16 == 0


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W held as packed int4 codes; x any float dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not int4_supported(linear):
            raise ValueError(f"int4 needs in_features % {GROUP_SIZE} == 0 and out_features % 16 "
                             f"== 0, got {linear.in_features}x{linear.out_features}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        codes, sz = quantize_int4(linear.weight.detach())
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, I] -> [T, O] in x's dtype
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scales_and_zeros).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W as int8 codes and one symmetric scale per output row."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
        self.register_buffer("codes", torch.round(w / scale[:, None]).clamp_(-127, 127)
                             .to(torch.int8))
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes,
                                               self.scales).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Bf16Linear(nn.Module):
    """y = x W^T (+ b) with W in bfloat16 (float32 accumulation inside the kernel)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantize_linears(model: nn.Module, kind: str, *, keep_bf16: tuple[str, ...] = ("lm_head",)
                     ) -> int:
    """Replace every nn.Linear of ``model`` by its quantized form, in place.

    Layers named in ``keep_bf16`` (the output head: its errors reach the logits
    directly, and GGUF files keep it at 8 bits) are held in bfloat16 instead, which
    is also faster than the int8 kernel once several rows decode together. Layers
    whose shape the int4 kernel cannot take get int8. Returns how many were replaced.
    A tied head stops sharing the embedding (the embedding stays float).
    """
    if kind not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {kind!r}; choose one of {QUANTIZATIONS} or None")
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            full = f"{parent_name}.{name}" if parent_name else name
            if full in keep_bf16:
                setattr(parent, name, Bf16Linear(child))
            elif kind == "int4" and int4_supported(child):
                setattr(parent, name, Int4Linear(child))
            else:
                setattr(parent, name, Int8Linear(child))
            replaced += 1
    return replaced
