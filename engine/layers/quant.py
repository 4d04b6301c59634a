"""Weight-only quantized linear layers for the CPU.

**A GGUF's own blocks** (:class:`GGUFLinear`, :class:`GGUFEmbedding`; the default
for a GGUF on the CPU): the weights stay as the file stores them (Q4_0, Q4_1, Q8_0,
Q4_K, Q5_K, Q6_K) and the native kernels (:mod:`formcast.engine.kernels.native`)
multiply int8-quantized activations by them, prompt rows and generated rows
alike, each row independently of the others. One copy of the weights, no float32.

The formats below (int4 groups of 32, int8 per channel) run on torch's own kernels
and keep float32 weights for prompts.

They run on torch's packed CPU kernels with bfloat16 activations, reading 4 or 8
bits per weight instead of 32: decode on a CPU is bound by reading weights, so
this is where CPU speed comes from. Int4 uses an asymmetric min/max code per group
of 32 inputs, the same layout as GGUF's Q4_1 blocks, so a Q4_1 file's own 4-bit
values come back exactly (up to the bf16 rounding of the scales).

**Prompt rows run in float32.** torch's int4 and int8 kernels dequantize as they go
and are compute-bound once a call has more than a few rows: faster than float32
(oneDNN) at one row, slower from a handful of rows on.
A quantized layer therefore also keeps its weight in float32 (oneDNN's packed
layout) and runs the rows of prompt tokens through it: prefill is float32-fast and
float32-exact, decode reads 4 bits. Which rows are prompt rows is decided by the
token's position (before the prompt's end or not), never by the batch, so a
request's result does not depend on what it was batched or chunked with; the
runner says which rows they are with :func:`prompt_rows`.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from formcast.engine.kernels.invariant_matmul import onednn_linear
from formcast.engine.kernels import native
from formcast.engine.layers.linear import onednn_available
from formcast.engine.loader.dequant import dequantize_rows

GROUP_SIZE = 32
QUANTIZATIONS = ("int4", "int8")

# rows of the current call that hold prompt tokens: None (none), True (all), or a
# (prompt rows, other rows) pair of index tensors
_PROMPT_ROWS: contextvars.ContextVar = contextvars.ContextVar("formcast_prompt_rows",
                                                              default=None)


@contextlib.contextmanager
def prompt_rows(is_prompt: list[bool] | None, device: torch.device | None = None
                ) -> Iterator[None]:
    """Within the block, quantized layers run the rows flagged in ``is_prompt``
    (one flag per row of their input) on their float32 weight. None: every row
    quantized."""
    if not is_prompt or not any(is_prompt):
        value = None
    elif all(is_prompt):
        value = True
    else:
        flags = torch.tensor(is_prompt)
        value = (flags.nonzero().flatten().to(device), (~flags).nonzero().flatten().to(device))
    token = _PROMPT_ROWS.set(value)
    try:
        yield
    finally:
        _PROMPT_ROWS.reset(token)


class _PromptFloat(nn.Module):
    """Base of the quantized layers: ``quantized(x)`` for generated-token rows, the
    float32 weight (oneDNN-packed, when kept) for prompt rows."""

    dense: torch.Tensor | None = None   # packed float32 weight, or None (not kept)
    dense_bias: torch.Tensor | None = None

    def keep_float(self, linear: nn.Linear) -> None:
        if not onednn_available() or linear.weight.device.type != "cpu":
            return
        with torch.no_grad():
            w = linear.weight.detach().float()
            self.dense = torch.ops.mkldnn._reorder_linear_weight(w, None)
            self.dense_bias = None if linear.bias is None else linear.bias.detach().float()

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _PROMPT_ROWS.get()
        if rows is None or self.dense is None or x.dtype != torch.float32:
            return self.quantized(x)
        if rows is True:
            return self._float(x)
        prompt, other = rows
        out = x.new_empty(x.shape[0], self.out_features)
        out[prompt] = self._float(x[prompt])
        out[other] = self.quantized(x[other])
        return out

    def _float(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.dense, self.dense_bias)  # (row-invariant at any M)


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


class Int4Linear(_PromptFloat):
    """y = x W^T (+ b) with W held as packed int4 codes; x any float dtype."""

    def __init__(self, linear: nn.Linear | None = None, *, codes: torch.Tensor | None = None,
                 scales_and_zeros: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if linear is not None:
            if not int4_supported(linear):
                raise ValueError(f"int4 needs in_features % {GROUP_SIZE} == 0 and out_features "
                                 f"% 16 == 0, got {linear.in_features}x{linear.out_features}")
            codes, scales_and_zeros = quantize_int4(linear.weight.detach())
            bias = None if linear.bias is None else linear.bias.detach()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 1))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.clone())

    @classmethod
    def from_blocks(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    bias: torch.Tensor | None = None) -> "Int4Linear":
        """A layer on a file's own 4-bit blocks (no requantization): ``codes`` [O, I]
        in 0..15, ``scale`` and ``zero`` [O, I/32] with value ``(code - 8) * scale +
        zero``. The codes are kept exactly; scale and zero become bfloat16, the
        kernel's format."""
        out_f, in_f = codes.shape
        if in_f % GROUP_SIZE or out_f % 16 or scale.shape != (out_f, in_f // GROUP_SIZE) \
                or zero.shape != scale.shape:
            raise ValueError(f"int4 blocks need [O, I] codes with I % {GROUP_SIZE} == 0, O % 16 "
                             f"== 0 and [O, I/{GROUP_SIZE}] scales; got codes "
                             f"{list(codes.shape)}, scale {list(scale.shape)}, zero "
                             f"{list(zero.shape)}")
        sz = torch.stack([scale.float(), zero.float()], dim=-1).transpose(0, 1).contiguous()
        return cls(codes=codes, scales_and_zeros=sz, bias=bias)

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, I] -> [T, O] in x's dtype
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scales_and_zeros).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int8Linear(_PromptFloat):
    """y = x W^T (+ b) with W as int8 codes and one symmetric scale per output row.

    On x86 it runs on FBGEMM's integer GEMM (:class:`_IntegerRows`), about twice
    as fast as torch's bfloat16-activation int8 kernel, elsewhere on that kernel.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
        self.register_buffer("codes", torch.round(w / scale[:, None]).clamp_(-127, 127)
                             .to(torch.int8))
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.integer = _IntegerRows.pack(self.codes, scale) if w.device.type == "cpu" else None

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        if self.integer is not None and x.device.type == "cpu":
            y = self.integer(x.float()).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes,
                                                   self.scales).to(x.dtype)
        return y if self.bias is None else y + self.bias


class _IntegerRows:
    """x W^T for int8 W on FBGEMM's u8 x s8 GEMM, with each row of x exact to about
    14 bits and independent of the other rows.

    FBGEMM quantizes its whole input with one range, which would tie a row's result
    to what it was batched with, and at 7 bits would cost precision. So each row is
    divided by its largest magnitude, and a constant row holding -1 and +1 pins the
    range: every call quantizes with the same step S. The rounding residual of each
    row, scaled up by 1/(2S), goes through the same call as a second row, and the
    two results add up to x W^T with the activations' error at S^2 instead of S.
    Integer accumulation is exact, so a row's output is bitwise the same at any
    batch size.
    """

    def __init__(self, packed, in_features: int) -> None:
        probe = torch.quantize_per_tensor_dynamic(torch.tensor([-1.0, 1.0]), torch.quint8, True)
        self.packed = packed
        self.step, self.zero = probe.q_scale(), probe.q_zero_point()
        self.pin = torch.zeros(1, in_features)
        self.pin[0, 0], self.pin[0, -1] = -1.0, 1.0

    @classmethod
    def pack(cls, codes: torch.Tensor, scale: torch.Tensor) -> "_IntegerRows | None":
        """None where FBGEMM is not available (not x86, or a torch without it)."""
        if "fbgemm" not in torch.backends.quantized.supported_engines or codes.shape[1] < 2:
            return None
        engine = torch.backends.quantized.engine
        try:
            # packed for FBGEMM whatever engine the process chose: the rounding
            # that __call__ mirrors is FBGEMM's
            torch.backends.quantized.engine = "fbgemm"
            with warnings.catch_warnings():  # quantized tensors are marked deprecated
                warnings.simplefilter("ignore")
                weight = torch._make_per_channel_quantized_tensor(
                    codes.cpu(), scale.double().cpu(),
                    torch.zeros(codes.shape[0], dtype=torch.long), 0)
                return cls(torch.ops.quantized.linear_prepack(weight, None), codes.shape[1])
        except (RuntimeError, AttributeError):
            return None
        finally:
            torch.backends.quantized.engine = engine

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, I] float32 -> [T, O] float32
        rows = x.shape[0]
        mag = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        u = x / mag
        # FBGEMM's rounding: to nearest even, and +1 reaches code 128 (reduce_range
        # narrows the step, not the clamp)
        codes = torch.round(u / self.step) + self.zero
        residual = (u - (codes - self.zero) * self.step) * (0.5 / self.step)
        y = torch.ops.quantized.linear_dynamic(torch.cat([u, residual, self.pin]),
                                               self.packed, True)
        return (y[:rows] + y[rows:2 * rows] * (2 * self.step)) * mag


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


HEAD_FORMATS = ("int8", "bfloat16")


def quantize_linears(model: nn.Module, kind: str, *, head: str = "int8",
                     head_names: tuple[str, ...] = ("lm_head",),
                     blocks: Mapping[str, Any] | None = None, prompt_float: bool = True) -> int:
    """Replace every nn.Linear of ``model`` by its quantized form, in place.

    Layers named in ``head_names`` (the output head: its errors reach the logits
    directly, and GGUF files keep it at 8 bits) get ``head``: "int8" (per output row,
    the default) or "bfloat16" (slower, and torch's bf16 GEMM there is linear in
    the rows). Layers whose shape the int4 kernel cannot take
    get int8. Returns how many were replaced. A tied head stops sharing the
    embedding (the embedding stays float).

    ``blocks`` maps layer names (``model.layers.0.self_attn.qkv_proj``) to a file's
    own 4-bit blocks (objects with ``codes``, ``scale`` and ``zero``, as
    :class:`formcast.engine.loader.gguf.Int4Blocks`); under ``kind="int4"`` those
    layers take them as they are instead of requantizing their float weights.

    ``prompt_float``: every int4/int8 layer also keeps its float32 weight, for
    prompt rows (module doc); costs that weight's memory once more.
    """
    if head not in HEAD_FORMATS:
        raise ValueError(f"unknown head format {head!r}; choose one of {HEAD_FORMATS}")
    if kind not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {kind!r}; choose one of {QUANTIZATIONS} or None")
    blocks = blocks or {}
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            full = f"{parent_name}.{name}" if parent_name else name
            own = blocks.get(full) if kind == "int4" else None
            if full in head_names:
                new = Bf16Linear(child) if head == "bfloat16" else Int8Linear(child)
            elif own is not None and tuple(own.codes.shape) == tuple(child.weight.shape):
                bias = None if child.bias is None else child.bias.detach()
                new = Int4Linear.from_blocks(own.codes, own.scale, own.zero, bias)
            elif kind == "int4" and int4_supported(child):
                new = Int4Linear(child)
            else:
                new = Int8Linear(child)
            if prompt_float and isinstance(new, _PromptFloat):
                new.keep_float(child)
            setattr(parent, name, new)
            replaced += 1
    return replaced


class GGUFLinear(nn.Module):
    """y = x W^T (+ b) with W kept in a GGUF's own blocks, as stored in the file.

    The native kernels (:mod:`formcast.engine.kernels.native`) quantize each row of
    ``x`` to int8 blocks of 32 and multiply by the blocks directly, prompt rows and
    generated rows alike: every row runs the same arithmetic whatever the batch,
    so a row's result does not depend on what it was batched with. Without the
    extension the weight is dequantized to float32 once, on first use.

    ``parts``: the weight as row blocks ``(blocks uint8 [O_i, bytes a row], qtype)``,
    stacked along the output (a fused q|k|v whose parts a file stores in different
    types stays one layer; neighbouring parts of one type become one). Tensors are plain attributes, not buffers: the model
    around them may be materialized with ``to_empty`` without touching them.
    """

    def __init__(self, parts: list[tuple[torch.Tensor, str]], in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        for blocks, qtype in parts:
            if qtype not in native.BLOCK_TYPES or blocks.dtype != torch.uint8 or \
                    blocks.dim() != 2 or blocks.shape[1] != native.block_bytes(qtype, in_features):
                raise ValueError(f"GGUF blocks of type {qtype} [{list(blocks.shape)}, "
                                 f"{blocks.dtype}] do not hold rows of {in_features} inputs")
        merged: list[tuple[torch.Tensor, str]] = []
        for blocks, qtype in parts:  # neighbours of one type: one kernel call
            if merged and merged[-1][1] == qtype:
                merged[-1] = (torch.cat([merged[-1][0], blocks]), qtype)
            else:
                merged.append((blocks.contiguous(), qtype))
        self.parts = merged
        self.in_features = in_features
        self.out_features = sum(b.shape[0] for b, _ in parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(),
                                                           requires_grad=False)
        self._dense: list[torch.Tensor] | None = None  # torch path only

    @property
    def qtypes(self) -> tuple[str, ...]:
        return tuple(q for _, q in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, I] -> [T, O] float32
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        dense: list[torch.Tensor | None] = [None] * len(self.parts)
        if not native.available():
            dense = self.dequantized()
        if len(self.parts) == 1:
            y = native.quant_matmul(x2, self.parts[0][0], self.parts[0][1], dense=dense[0])
            if self.bias is None:  # (the decode step's common case: no more ops)
                return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
        else:
            y = x2.new_empty(x2.shape[0], self.out_features)
            start = 0
            for (blocks, qtype), w in zip(self.parts, dense):
                end = start + blocks.shape[0]
                native.quant_matmul(x2, blocks, qtype, out=y[:, start:end], dense=w)
                start = end
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> list[torch.Tensor]:
        """Each part's weight as float32 [O_i, I] (made once, then kept: the torch path)."""
        if self._dense is None:
            self._dense = [dequantize_rows(b, q) for b, q in self.parts]
        return self._dense


class GGUFEmbedding(nn.Module):
    """Token embedding kept in a GGUF's blocks: the rows asked for are dequantized
    on the fly (a step reads a few rows of a table the head may share)."""

    def __init__(self, blocks: torch.Tensor, qtype: str, embedding_dim: int) -> None:
        super().__init__()
        self.blocks, self.qtype = blocks.contiguous(), qtype
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids [T] -> [T, E] float32
        rows = self.blocks[token_ids.reshape(-1)]
        if self.qtype == "Q8_0":  # (the common case, in torch: no numpy round trip)
            v = rows.view(rows.shape[0], -1, 34)
            d = v[..., :2].contiguous().view(torch.float16).float()   # [T, E/32, 1]
            q = v[..., 2:].contiguous().view(torch.int8).float()      # [T, E/32, 32]
            out = (q * d).view(rows.shape[0], self.embedding_dim)
        else:
            out = dequantize_rows(rows, self.qtype)
        return out.view(*token_ids.shape, self.embedding_dim)
