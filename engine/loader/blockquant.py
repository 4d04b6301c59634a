"""Dequantize DeepSeek's block-scaled checkpoints to float32.

- FP8: ``float8_e4m3fn`` values, one scale per ``128 x 128`` block (the last block
  of a row or column may be partial), scales in float32/bfloat16 or as UE8M0
  exponents (``float8_e8m0fnu`` or raw ``uint8``: scale ``2 ** (byte - 127)``).
- FP4 (routed experts): E2M1 codes packed two per byte in an ``int8`` tensor, element
  ``2i`` in the low nibble and ``2i + 1`` in the high one, one scale per 32 values
  along the row.

Both are stored multiplied out: ``real = value * scale``.
"""

from __future__ import annotations

import torch

FP8_BLOCK = (128, 128)
FP4_GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def decode_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as float32: UE8M0 exponents (``float8_e8m0fnu``/``uint8``) become
    ``2 ** (byte - 127)``; float scales are returned as they are."""
    if scale.dtype == torch.uint8 or scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return torch.exp2(scale.view(torch.uint8).float() - 127.0)
    if not scale.dtype.is_floating_point:
        raise ValueError(f"block scales must be float or UE8M0, got {scale.dtype}")
    return scale.float()


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """FP8 ``weight [..., R, C]`` with ``scale [..., ceil(R/b0), ceil(C/b1)]`` -> float32.

    Raises ``ValueError`` when the scale grid does not fit the weight and block.
    """
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != tuple(weight.shape[:-2]) + grid:
        raise ValueError(f"FP8 weight {tuple(weight.shape)} with {block[0]}x{block[1]} blocks needs "
                         f"scales {tuple(weight.shape[:-2]) + grid}, got {tuple(scale.shape)}")
    s = decode_scales(scale).repeat_interleave(block[0], dim=-2)[..., :rows, :]
    s = s.repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.float() * s


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """Packed E2M1 ``[..., R, C/2]`` (int8/uint8) with ``scale [..., R, C/group]`` ->
    float32 ``[..., R, C]``.

    Raises ``ValueError`` when the scale shape does not fit.
    """
    cols = 2 * packed.shape[-1]
    if cols % group or tuple(scale.shape) != tuple(packed.shape[:-1]) + (cols // group,):
        raise ValueError(f"FP4 weight of {cols} columns per row (packed {tuple(packed.shape)}) needs "
                         f"scales {tuple(packed.shape[:-1]) + (cols // group,)}, got {tuple(scale.shape)}")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = packed.contiguous().view(torch.uint8).long()
    values = torch.stack((table[codes & 0xF], table[codes >> 4]), dim=-1).flatten(-2)
    return values * decode_scales(scale).repeat_interleave(group, dim=-1)
