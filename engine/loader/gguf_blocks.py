"""A Llama GGUF's weights kept as the file stores them: quantized blocks stay blocks.

What the native CPU kernels run on (:class:`formcast.engine.layers.quant.GGUFLinear`):
one copy of the weights in memory, in the file's own bytes, rather than the float32
weights :func:`formcast.engine.loader.gguf.load_gguf` makes. Only the rows of q and
k are moved (put back in transformers' RoPE order, as ``load_gguf`` does); the
bytes of a row are never touched. Float tensors (norms) come back as float32.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from gguf import GGUFReader, ReaderTensor

from formcast.engine.config import LlamaConfig
from formcast.engine.errors import CorruptModelError
from formcast.engine.kernels.native import BLOCK_TYPES
from formcast.engine.loader.dequant import dequantize, nbytes_of
from formcast.engine.loader.gguf import (_unpermute_rope_rows, config_from_reader, hf_name,
                                         open_gguf)
from formcast.engine.loader.hf import expected_shapes


@dataclass(frozen=True)
class Blocks:
    """One 2-D weight ``[O, I]`` as GGUF blocks: ``data`` uint8 ``[O, bytes a row]``."""

    data: torch.Tensor
    qtype: str
    in_features: int


def read_gguf_blocks(path: str | os.PathLike[str], *,
                     fuse: Callable[[LlamaConfig], Mapping[str, Sequence[str]]] | None = None,
                     reader: GGUFReader | None = None
                     ) -> tuple[LlamaConfig, dict[str, Blocks | torch.Tensor]]:
    """The config and weights of a Llama GGUF, by transformers name: 2-D weights in a
    block type of :data:`BLOCK_TYPES` as :class:`Blocks` (read from the file), the
    others as float32 tensors.

    ``fuse(config)`` maps a new name to weights whose rows it stacks (a fused q|k|v): when
    all are blocks of one type and width, they are read straight into one buffer
    and come back under the new name only (no copy made and dropped). ``reader``: the
    file already parsed by :func:`open_gguf` (a large vocabulary takes seconds).

    Raises
    ------
    ModelNotFoundError, CorruptModelError, UnsupportedModelError
        As :func:`formcast.engine.loader.gguf.read_gguf_config`; also for missing
        tensors and data past the end of the file.
    """
    path = Path(path)
    reader = reader or open_gguf(path)
    config = config_from_reader(reader, path)
    shapes = expected_shapes(config)
    file_size = path.stat().st_size
    found: dict[str, tuple[ReaderTensor, tuple[int, ...]]] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or name not in shapes:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape != shapes[name]:
            raise CorruptModelError(f"{path}: tensor {t.name} has shape {list(shape)}, but the "
                                    f"metadata implies {list(shapes[name])}")
        if t.data_offset + nbytes_of(t.tensor_type, shape) > file_size:
            raise CorruptModelError(f"{path}: data of tensor {t.name} runs past the end of the "
                                    "file; the file is truncated. Delete it and download it again.")
        found[name] = (t, shape)
    missing = [n for n in shapes if n not in found and not
               (n == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        raise CorruptModelError(f"{path}: missing tensors for {', '.join(missing[:5])}")
    out: dict[str, Blocks | torch.Tensor] = {}
    with open(path, "rb") as f:
        for fused, names in (fuse(config) if fuse else {}).items():
            parts = [found.get(n) for n in names]
            if any(p is None or not _is_blocks(*p) for p in parts) or \
                    len({(p[0].tensor_type, p[1][1]) for p in parts}) != 1:
                continue
            width = nbytes_of(parts[0][0].tensor_type, parts[0][1]) // parts[0][1][0]
            data = torch.empty(sum(p[1][0] for p in parts), width, dtype=torch.uint8)
            start = 0
            for name in names:
                t, shape = found.pop(name)
                _read_rows(f, t, data[start:start + shape[0]], config, name, path)
                start += shape[0]
            out[fused] = Blocks(data, parts[0][0].tensor_type.name, parts[0][1][1])
        for name, (t, shape) in found.items():
            if _is_blocks(t, shape):
                data = torch.empty(shape[0], nbytes_of(t.tensor_type, shape) // shape[0],
                                   dtype=torch.uint8)
                _read_rows(f, t, data, config, name, path)
                out[name] = Blocks(data, t.tensor_type.name, shape[1])
                continue
            try:
                weight = dequantize(t.data, t.tensor_type, shape)
            except ValueError as exc:
                raise CorruptModelError(f"{path}: tensor {t.name}: {exc}") from exc
            order = _rope_order(config, name, shape[0])
            out[name] = weight if order is None else weight[order].contiguous()
    return config, out


def native_blocks(reader: GGUFReader, config: LlamaConfig) -> bool:
    """Whether the file is a plain Llama (no biases) whose 2-D weights are all in
    block types of :data:`BLOCK_TYPES`: what the native decoder step runs as stored."""
    return type(config) is LlamaConfig and config.architecture == "llama" and \
        not config.attention_bias and not config.mlp_bias and \
        all(t.tensor_type.name in BLOCK_TYPES for t in reader.tensors if len(t.shape) >= 2)


def _is_blocks(t: ReaderTensor, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and t.tensor_type.name in BLOCK_TYPES


def _rope_order(config: LlamaConfig, name: str, rows: int) -> torch.Tensor | None:
    """The row order that puts q or k back in transformers' RoPE layout, else None."""
    heads = (config.num_attention_heads if ".self_attn.q_proj." in name else
             config.num_key_value_heads if ".self_attn.k_proj." in name else None)
    if heads is None:
        return None
    return _unpermute_rope_rows(torch.arange(rows)[:, None], heads)[:, 0]


def _read_rows(f: BinaryIO, t: ReaderTensor, into: torch.Tensor, config: LlamaConfig,
               name: str, path: Path) -> None:
    """Read tensor ``t``'s bytes into ``into`` (uint8 [rows, bytes a row]), rows in
    transformers' order. Read, not copied out of the mapping: mapped pages would
    count as resident memory beside the copy."""
    f.seek(t.data_offset)
    if f.readinto(into.numpy()) != into.numel():
        raise CorruptModelError(f"{path}: tensor {t.name} could not be read whole")
    order = _rope_order(config, name, into.shape[0])
    if order is not None:
        into.copy_(into[order])
