"""Load a GGUF file into transformers-named float32 weights, with an on-disk cache.

Llama and the families that share its module (``general.architecture`` llama,
qwen2, qwen3, gemma3, phi3: :mod:`formcast.engine.loader.gguf_arch`).

Parsing is ``gguf.GGUFReader``; anything it trips over becomes a
:class:`~formcast.engine.errors.CorruptModelError` naming the file. Dequantized weights are
cached next to the GGUF (:mod:`formcast.engine.loader.weight_cache`): a parse costs
~2 s for SmolLM2, mostly the 49k tokenizer strings, plus ~1 s of dequantization.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader
from gguf.gguf_reader import ReaderTensor

from formcast.engine.config import LlamaConfig
from formcast.engine.errors import CorruptModelError, ModelError, ModelNotFoundError, UnsupportedModelError
from formcast.engine.loader.dequant import SUPPORTED_TYPES, dequantize, nbytes_of
from formcast.engine.loader.gguf_arch import (ROPE_FACTOR_TENSORS, SUPPORTED_ARCHITECTURES,
                                              family_config, hf_name, stored_to_hf)
from formcast.engine.loader.hf import expected_shapes


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Parse a GGUF file's header and tensor table (tensor data stays memory-mapped).

    Raises
    ------
    ModelNotFoundError
        No such file.
    CorruptModelError
        Not a GGUF file, or truncated / damaged so that its header cannot be parsed.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            head = f.read(4)
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise ModelNotFoundError(f"{path}: no such GGUF file") from exc
    except OSError as exc:
        raise ModelError(f"{path}: cannot read the file ({exc})") from exc
    if size == 0:
        raise CorruptModelError(f"{path}: the file is empty; delete it and download it again")
    if head != b"GGUF":
        raise CorruptModelError(
            f"{path}: not a GGUF file (it starts with {head!r}, not the magic b'GGUF')")
    try:
        return GGUFReader(path)
    # GGUFReader parses untrusted bytes with numpy views; a damaged or truncated file
    # surfaces as whichever exception the first short read or bad value causes
    # (IndexError, ValueError, KeyError, UnicodeDecodeError, ...), so all mean "corrupt".
    except Exception as exc:  # noqa: BLE001
        raise CorruptModelError(
            f"{path}: truncated or damaged GGUF file ({size} bytes); reading its header and "
            f"tensor table failed with {type(exc).__name__}: {exc}. Delete it and download "
            "it again.") from exc


def _value(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _number(reader: GGUFReader, key: str, path: Path, *, integer: bool,
            default: int | float | None = None) -> Any:
    value = _value(reader, key)
    if value is None:
        if default is None:
            raise CorruptModelError(f"{path}: required metadata key {key!r} is missing")
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise CorruptModelError(f"{path}: metadata key {key!r} should be a "
                                f"{'integer' if integer else 'number'}, found {value!r}")
    return value


def _rope_scaling(reader: GGUFReader, path: Path, arch: str) -> dict[str, Any] | None:
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # Llama 3.1-style RoPE: llama.cpp stores per-frequency factors instead of the
        # scaling parameters, which transformers' llama3 rope type needs.
        raise UnsupportedModelError(
            f"{path}: carries a rope_freqs tensor (Llama 3.1-style RoPE scaling), which "
            "formcast does not support yet; use the HF-layout folder of this model instead")
    kind = _value(reader, f"{arch}.rope.scaling.type")
    factor = _value(reader, f"{arch}.rope.scaling.factor")
    if kind is None and _value(reader, f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", _value(reader, f"{arch}.rope.scale_linear")
    if kind is None and arch != "llama" and factor is not None and factor != 1.0:
        kind = "linear"  # (Gemma 3 files give a factor alone)
    if kind is None or kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind)}
    if factor is not None:
        scaling["factor"] = float(factor)
    for suffix, hf_key in (("original_context_length", "original_max_position_embeddings"),
                           ("attn_factor", "attention_factor"),
                           ("yarn_beta_fast", "beta_fast"),
                           ("yarn_beta_slow", "beta_slow")):
        value = _value(reader, f"{arch}.rope.scaling.{suffix}")
        if value is not None:
            scaling[hf_key] = value
    return scaling


def config_from_reader(reader: GGUFReader, path: Path) -> LlamaConfig:
    """Build the config of an opened GGUF from its metadata and tensor table: a
    :class:`LlamaConfig`, or a :class:`DecoderConfig` for another family (or a
    Llama with a sliding window)."""
    try:
        arch = _value(reader, "general.architecture")
        if arch is None:
            raise CorruptModelError(f"{path}: metadata key 'general.architecture' is missing")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{path}: GGUF architecture {arch!r} is not supported; formcast runs "
                f"{', '.join(map(repr, SUPPORTED_ARCHITECTURES))} models (a Mistral GGUF "
                "says 'llama')")
        p = f"{arch}."
        hidden = _number(reader, p + "embedding_length", path, integer=True)
        heads = _number(reader, p + "attention.head_count", path, integer=True)
        rope_dim = _number(reader, p + "rope.dimension_count", path, integer=True,
                           default=_value(reader, p + "attention.key_length") or
                           hidden // max(heads, 1))
        head_dim = _number(reader, p + "attention.key_length", path, integer=True,
                           default=rope_dim)
        if rope_dim != head_dim:
            raise UnsupportedModelError(
                f"{path}: partial rotary embedding (rope.dimension_count {rope_dim} < head "
                f"dim {head_dim}) is not supported")
        names = {t.name for t in reader.tensors}
        vocab = _value(reader, p + "vocab_size")
        if vocab is None:
            tokens = reader.get_field("tokenizer.ggml.tokens")
            if tokens is not None:
                vocab = len(tokens.data)
            elif "token_embd.weight" in names:
                vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight")
                            .shape[-1])
            else:
                raise CorruptModelError(f"{path}: cannot tell the vocabulary size (no "
                                        f"{p}vocab_size, tokenizer.ggml.tokens or token_embd)")
        base = dict(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=_number(reader, p + "feed_forward_length", path, integer=True),
            num_hidden_layers=_number(reader, p + "block_count", path, integer=True),
            num_attention_heads=heads,
            num_key_value_heads=_number(reader, p + "attention.head_count_kv", path,
                                        integer=True, default=heads),
            head_dim=head_dim,
            rms_norm_eps=float(_number(reader, p + "attention.layer_norm_rms_epsilon", path,
                                       integer=False, default=1e-5)),
            rope_theta=float(_number(reader, p + "rope.freq_base", path, integer=False,
                                     default=10000.0)),
            rope_scaling=_rope_scaling(reader, path, arch),
            max_position_embeddings=_number(reader, p + "context_length", path, integer=True,
                                            default=2048),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            mlp_bias="blk.0.ffn_gate.bias" in names or "blk.0.ffn_down.bias" in names,
            architecture=str(arch),
        )
        return family_config(
            arch, base, lambda key: _value(reader, p + key), names,
            lambda name: next(t for t in reader.tensors if t.name == name).data)
    except UnicodeDecodeError as exc:
        raise CorruptModelError(f"{path}: metadata holds invalid UTF-8 ({exc})") from exc
    except ValueError as exc:  # LlamaConfig's own validation
        raise CorruptModelError(f"{path}: inconsistent model metadata ({exc})") from exc


def read_gguf_config(path: str | os.PathLike[str]) -> LlamaConfig:
    """Read a GGUF file's model config from its metadata, without touching tensor data.

    Parameters
    ----------
    path : str or path
        The ``.gguf`` file.

    Returns
    -------
    LlamaConfig
        A :class:`DecoderConfig` for a family other than Llama.

    Raises
    ------
    ModelNotFoundError
        No such file.
    CorruptModelError
        Not a GGUF file, truncated, or missing required metadata.
    UnsupportedModelError
        An architecture formcast does not run (the message lists those it does),
        or a variant of one it does not.
    """
    return config_from_reader(open_gguf(path), Path(path))


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k projection rows (weights or biases).

    llama.cpp's RoPE rotates adjacent pairs (x0, x1), (x2, x3), ...; transformers'
    ``rotate_half`` pairs x_j with x_{j + d/2}. The converter therefore moves row
    ``s * d/2 + j`` of each head to row ``2 * j + s``; this puts it back.
    """
    head_dim = w.shape[0] // n_heads
    rest = w.shape[1:]
    # [n_heads * d, ...] -> [n_heads, d/2, 2, ...] -> [n_heads, 2, d/2, ...]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape) \
        .contiguous()


def _weight(t: ReaderTensor, name: str, shape: tuple[int, ...], config: LlamaConfig,
            path: Path, file_size: int) -> torch.Tensor:
    if t.tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
        raise UnsupportedModelError(
            f"{path}: tensor {t.name} is stored as {t.tensor_type.name}, which formcast cannot "
            f"dequantize (supported: {supported}); use a GGUF quantized with one of those")
    end = t.data_offset + nbytes_of(t.tensor_type, shape)
    if end > file_size:
        raise CorruptModelError(
            f"{path}: data of tensor {t.name} ends at byte {end}, past the end of the file "
            f"({file_size} bytes); the file is truncated. Delete it and download it again.")
    try:
        w = dequantize(t.data, t.tensor_type, shape)
    except ValueError as exc:
        raise CorruptModelError(f"{path}: tensor {t.name}: {exc}") from exc
    if config.architecture == "llama" and ".self_attn.q_proj." in name:
        w = _unpermute_rope_rows(w, config.num_attention_heads)
    elif config.architecture == "llama" and ".self_attn.k_proj." in name:
        w = _unpermute_rope_rows(w, config.num_key_value_heads)
    convert = stored_to_hf(config.architecture, name)
    return w if convert is None else convert(w)


_QKV = ("q_proj", "k_proj", "v_proj")


def _fused_name(name: str) -> str:
    """The fused ``qkv_proj`` name a q, k or v projection's tensor belongs to
    (``name`` itself for any other tensor)."""
    for part in _QKV:
        if f".self_attn.{part}." in name:
            return name.replace(part, "qkv_proj")
    return name


def _fused_weight(parts: list[tuple[str, ReaderTensor]], shape: tuple[int, ...],
                  config: LlamaConfig, path: Path, file_size: int) -> torch.Tensor:
    """A fused ``qkv_proj`` weight or bias of ``shape`` from its q, k and v tensors."""
    ordered = sorted(parts, key=lambda p: _QKV.index(p[0].split(".self_attn.")[1].split(".")[0]))
    found = [tuple(int(d) for d in reversed(t.shape.tolist())) for _, t in ordered]
    if sum(f[0] for f in found) != shape[0] or any(f[1:] != shape[1:] for f in found):
        raise CorruptModelError(
            f"{path}: tensors {', '.join(t.name for _, t in ordered)} have shapes "
            f"{[list(f) for f in found]}, which do not make the {list(shape)} the metadata implies")
    return torch.cat([_weight(t, name, f, config, path, file_size)
                      for (name, t), f in zip(ordered, found)])


def load_gguf(path: str | os.PathLike[str]) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Parse and dequantize a GGUF into float32 weights with transformers names.

    Raises
    ------
    ModelNotFoundError, CorruptModelError, UnsupportedModelError
        As for :func:`read_gguf_config`; also for missing or unexpected tensors,
        shapes that disagree with the metadata, data past the end of the file and
        tensor types formcast cannot dequantize.
    """
    path = Path(path)
    reader = open_gguf(path)
    config = config_from_reader(reader, path)
    shapes = expected_shapes(config)
    file_size = path.stat().st_size
    by_name: dict[str, ReaderTensor] = {}
    parts: dict[str, list[tuple[str, ReaderTensor]]] = {}  # fused name -> its stored parts
    for t in reader.tensors:
        if t.name in ROPE_FACTOR_TENSORS:  # (read into the config)
            continue
        name = hf_name(t.name, config.architecture)
        if name is None:
            raise UnsupportedModelError(
                f"{path}: unexpected tensor {t.name!r} for a {config.architecture} model; "
                "formcast does not know how to use it")
        fused = _fused_name(name)
        if name not in shapes and fused in shapes:  # (Phi-3 files with q, k, v apart)
            parts.setdefault(fused, []).append((name, t))
            continue
        if name not in shapes:
            raise CorruptModelError(
                f"{path}: tensor {t.name} does not fit the metadata (block_count "
                f"{config.num_hidden_layers})")
        by_name[name] = t
    missing = [n for n in shapes if n not in by_name and len(parts.get(n, ())) != 3]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CorruptModelError(f"{path}: missing tensors for {', '.join(missing[:5])}{more}")
    weights: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name in parts:
            weights[name] = _fused_weight(parts[name], shape, config, path, file_size)
            continue
        t = by_name[name]
        found = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims inner-first
        if found != shape:
            raise CorruptModelError(f"{path}: tensor {t.name} has shape {list(found)}, but the "
                                    f"metadata implies {list(shape)}")
        weights[name] = _weight(t, name, shape, config, path, file_size)
    return config, weights


# ------------------------------------------------------- 4-bit blocks, kept 4-bit

INT4_TYPES = ("Q4_0", "Q4_1")


@dataclasses.dataclass(frozen=True)
class Int4Blocks:
    """One linear weight ``[O, I]`` as 4-bit codes in groups of 32 along ``I``.

    Element value = ``(code - 8) * scale + zero``, the form torch's int4 CPU kernel
    computes, so a file's blocks map onto it without requantizing: Q4_1 stores
    ``d * q + m`` (scale ``d``, zero ``m + 8 d``), Q4_0 stores ``d * (q - 8)``
    (scale ``d``, zero 0).

    Attributes
    ----------
    codes : torch.Tensor
        uint8 ``[O, I]``, values 0..15, the file's own.
    scale, zero : torch.Tensor
        float32 ``[O, I / 32]``, exact from the file's float16 ``d`` and ``m``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[O, I]`` values, as the file defines them."""
        o, i = self.codes.shape
        g = (self.codes.float() - 8).view(o, i // 32, 32)
        return (g * self.scale[..., None] + self.zero[..., None]).view(o, i)

    def rows(self, order: torch.Tensor) -> "Int4Blocks":
        return Int4Blocks(self.codes[order], self.scale[order], self.zero[order])

    @staticmethod
    def cat(parts: list["Int4Blocks"]) -> "Int4Blocks":
        """Row-wise concatenation (a fused projection of several weights)."""
        return Int4Blocks(torch.cat([p.codes for p in parts]),
                          torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]))


def _int4_blocks(data, qtype: str, shape: tuple[int, int]) -> Int4Blocks:
    """Split Q4_0 / Q4_1 block bytes into codes, scales and zeros (no arithmetic on
    the codes: each block's 16 bytes hold element j in the low nibble of byte j and
    element j + 16 in its high nibble)."""
    import numpy as np

    o, i = shape
    width = 18 if qtype == "Q4_0" else 20
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.size != o * i // 32 * width:
        raise ValueError(f"{qtype} tensor of shape {list(shape)} needs {o * i // 32 * width} "
                         f"bytes, found {raw.size}")
    blocks = raw.reshape(o, i // 32, width)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    qs = blocks[..., width - 16:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(o, i)
    return Int4Blocks(torch.from_numpy(codes.copy()), torch.from_numpy(d), torch.from_numpy(zero))


def stores_quantized(reader: GGUFReader) -> bool:
    """Whether a GGUF keeps any matrix in quantized blocks (not F32, F16 or BF16)."""
    return any(len(t.shape) == 2 and t.tensor_type.name not in ("F32", "F16", "BF16")
               for t in reader.tensors)


def read_int4_blocks(path: str | os.PathLike[str], *,
                     reader: GGUFReader | None = None) -> dict[str, Int4Blocks]:
    """The weights a GGUF stores as Q4_0 or Q4_1, kept 4-bit, by transformers
    name (a Llama file's q/k rows put back in transformers' RoPE order, as
    :func:`load_gguf` does).
    Other tensors are not read. Empty for a file without such tensors.
    ``reader``: the file already opened (:func:`open_gguf`), not parsed again.

    Raises
    ------
    ModelNotFoundError, CorruptModelError, UnsupportedModelError
        As :func:`read_gguf_config`; also for a truncated tensor.
    """
    path = Path(path)
    reader = reader or open_gguf(path)
    config = config_from_reader(reader, path)
    file_size = path.stat().st_size
    out: dict[str, Int4Blocks] = {}
    for t in reader.tensors:
        name = hf_name(t.name, config.architecture)
        if name is None or t.tensor_type.name not in INT4_TYPES or len(t.shape) != 2:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape[1] % 32:
            continue
        if t.data_offset + nbytes_of(t.tensor_type, shape) > file_size:
            raise CorruptModelError(f"{path}: data of tensor {t.name} runs past the end of the "
                                    "file; the file is truncated. Delete it and download it again.")
        try:
            blocks = _int4_blocks(t.data, t.tensor_type.name, shape)
        except ValueError as exc:
            raise CorruptModelError(f"{path}: tensor {t.name}: {exc}") from exc
        heads = (None if config.architecture != "llama" else
                 config.num_attention_heads if ".self_attn.q_proj." in name else
                 config.num_key_value_heads if ".self_attn.k_proj." in name else None)
        if heads is not None:
            order = _unpermute_rope_rows(torch.arange(shape[0])[:, None], heads)[:, 0]
            blocks = blocks.rows(order)
        out[name] = blocks
    return out
