"""A Llama GGUF's weights kept as the file stores them: quantized blocks stay blocks.

What the native CPU kernels run on (:class:`formcast.engine.layers.quant.GGUFLinear`):
one copy of the weights in memory, in the file's own bytes, rather than the float32
weights :func:`formcast.engine.loader.gguf.load_gguf` makes. Only the rows of q and
k are moved (put back in transformers' RoPE order, as ``load_gguf`` does); the
bytes of a row are never touched. Float tensors (norms) come back as float32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

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


def blocks_cover(path: str | os.PathLike[str]) -> bool:
    """Whether every 2-D weight of the Llama GGUF at ``path`` is stored in a block type
    the native kernels multiply (:data:`BLOCK_TYPES`), so that the model can run on
    the file's blocks alone. Reads the header only."""
    reader = open_gguf(path)
    mats = [t for t in reader.tensors if len(t.shape) == 2]
    return bool(mats) and all(t.tensor_type.name in BLOCK_TYPES for t in mats)


def read_gguf_blocks(path: str | os.PathLike[str]
                     ) -> tuple[LlamaConfig, dict[str, Blocks | torch.Tensor]]:
    """The config and weights of a Llama GGUF, by transformers name: 2-D weights in a
    block type of :data:`BLOCK_TYPES` as :class:`Blocks` (read from the file), the
    others as float32 tensors.

    Raises
    ------
    ModelNotFoundError, CorruptModelError, UnsupportedModelError
        As :func:`formcast.engine.loader.gguf.read_gguf_config`; also for missing
        tensors and data past the end of the file.
    """
    path = Path(path)
    reader = open_gguf(path)
    config = config_from_reader(reader, path)
    shapes = expected_shapes(config)
    file_size = path.stat().st_size
    out: dict[str, Blocks | torch.Tensor] = {}
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
        qtype = t.tensor_type.name
        if len(shape) == 2 and qtype in BLOCK_TYPES:
            # read, not copied from the mapping: the mapped pages would count as
            # resident memory beside the copy until the file is unmapped
            data = torch.empty(shape[0], nbytes_of(t.tensor_type, shape) // shape[0],
                               dtype=torch.uint8)
            with open(path, "rb") as f:
                f.seek(t.data_offset)
                if f.readinto(data.numpy()) != data.numel():
                    raise CorruptModelError(f"{path}: tensor {t.name} could not be read whole")
            weight: Blocks | torch.Tensor = Blocks(data, qtype, shape[1])
        else:
            try:
                weight = dequantize(t.data, t.tensor_type, shape)
            except ValueError as exc:
                raise CorruptModelError(f"{path}: tensor {t.name}: {exc}") from exc
        heads = (config.num_attention_heads if ".self_attn.q_proj." in name else
                 config.num_key_value_heads if ".self_attn.k_proj." in name else None)
        if heads is not None:
            order = _unpermute_rope_rows(torch.arange(shape[0])[:, None], heads)[:, 0]
            weight = Blocks(weight.data[order], weight.qtype, weight.in_features) \
                if isinstance(weight, Blocks) else weight[order].contiguous()
        out[name] = weight
    missing = [n for n in shapes if n not in out and not
               (n == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        raise CorruptModelError(f"{path}: missing tensors for {', '.join(missing[:5])}")
    return config, out
