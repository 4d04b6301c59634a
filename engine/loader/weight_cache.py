"""The float32 cache of a GGUF's dequantized weights, next to the file.

``<file>.formcast-f32.safetensors`` makes a second load a plain safetensors read
instead of a parse plus dequantization. It records the GGUF's size and
modification time, and is ignored (then rebuilt) when either differs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from formcast.engine.config import LlamaConfig
from formcast.engine.errors import CorruptModelError
from formcast.engine.loader.hf import check_weights
from formcast.engine.models.decoder_config import DecoderConfig

_log = logging.getLogger(__name__)

CACHE_SUFFIX = ".formcast-f32.safetensors"
# Bump when the cached tensors would come out differently (naming, permutation, config).
_CACHE_FORMAT = "formcast-gguf-f32/1"


def cache_path(path: str | os.PathLike[str]) -> Path:
    """Where the float32 cache of the GGUF at ``path`` lives."""
    path = Path(path)
    return path.with_name(path.name + CACHE_SUFFIX)


def _cache_key(path: Path) -> dict[str, str]:
    st = path.stat()
    return {"format": _CACHE_FORMAT, "gguf_size": str(st.st_size),
            "gguf_mtime_ns": str(st.st_mtime_ns)}


def read_cache(path: str | os.PathLike[str]) -> tuple[LlamaConfig, dict[str, torch.Tensor]] | None:
    """The cached float32 weights of a GGUF, or None if absent, stale or unreadable.

    The cache is stale when the GGUF's size or modification time differs from the
    one recorded when the cache was written. Does not modify anything.
    """
    path = Path(path)
    target = cache_path(path)
    try:
        key = _cache_key(path)
        with safe_open(target, framework="pt") as f:
            meta = f.metadata() or {}
            if any(meta.get(k) != v for k, v in key.items()):
                _log.info("formcast: weight cache %s is stale; rebuilding it", target)
                return None
            fields = json.loads(meta["config"])
            config = (DecoderConfig.from_dict(fields) if meta.get("config_class") == "DecoderConfig"
                      else LlamaConfig(**fields))
            weights = {name: f.get_tensor(name) for name in f.keys()}
        check_weights(weights, config, origin=target)
    except FileNotFoundError:
        return None
    except (OSError, SafetensorError, ValueError, TypeError, KeyError, CorruptModelError) as exc:
        _log.warning("formcast: ignoring unreadable weight cache %s (%s)", target, exc)
        return None
    return config, weights


def write_cache(path: str | os.PathLike[str], config: LlamaConfig,
                weights: dict[str, torch.Tensor]) -> Path | None:
    """Write the float32 cache of the GGUF at ``path`` atomically; None if it could not.

    A folder that is not writable (or a full disk) only costs the speed-up, so
    failures are logged, not raised.
    """
    path = Path(path)
    target = cache_path(path)
    meta = {**_cache_key(path), "config": json.dumps(dataclasses.asdict(config)),
            "config_class": type(config).__name__}
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
        save_file({k: v.to(torch.float32).contiguous() for k, v in weights.items()}, tmp,
                  metadata=meta)
        os.replace(tmp, target)
        tmp = None
    except (OSError, SafetensorError) as exc:
        _log.info("formcast: not caching weights of %s (%s)", path, exc)
        return None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return target
