"""Native CPU kernels (``qgemm.cpp``): quantized GEMV/GEMM on a GGUF's own blocks.

The C++ source is compiled with the system's C++ compiler on first use, against
the installed torch's headers, and cached under ``$FORMCAST_CACHE_DIR/native``
(default ``~/.cache/formcast/native``) by a hash of the sources, the torch version
and the compiler; later processes load the cached library. The kernels pick the
best ISA of the machine at run time (portable, AVX2+FMA, AVX-512 VNNI), so one
build serves every x86 CPU.

``FORMCAST_NATIVE=0`` turns the extension off; without a compiler (or when the
build fails) a warning says what is missing and :func:`available` is False. Then
:func:`quant_matmul` runs its pure-torch form: the same activation codes, the
weights dequantized in float32.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

_SOURCES = tuple(Path(__file__).with_name(n)
                 for n in ("qgemm.cpp", "qgemm_body.inc", "layer_body.inc", "layer.inc"))

# ggml's block types: id, elements a block, bytes a block
BLOCK_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}
ISAS = ("generic", "avx2", "avx512_vnni")


class _State:
    """The process's one build attempt (loaded library or the reason it is not)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tried = False
        self.reason: str | None = None
        self.best_isa = 0  # the machine's best level, once loaded


_state = _State()


def available() -> bool:
    """Whether the native kernels are loaded (building them on the first call)."""
    if _state.tried:
        return _state.reason is None
    with _state.lock:
        if not _state.tried:
            _state.reason = _load()
            _state.tried = True
            if _state.reason is not None and "FORMCAST_NATIVE=0" not in _state.reason:
                warnings.warn(f"formcast: native CPU kernels unavailable ({_state.reason}); "
                              "running the slower pure-torch kernels", RuntimeWarning,
                              stacklevel=2)
    return _state.reason is None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (after it was asked), else None."""
    return _state.reason if _state.tried else None


def isa() -> str:
    """The ISA level the kernels run at: "avx512_vnni", "avx2" or "generic"
    (``FORMCAST_NATIVE_ISA`` may lower it); "torch" without the extension."""
    if not available():
        return "torch"
    return ISAS[_isa_index()]


def _isa_index() -> int:
    best = _state.best_isa
    asked = os.environ.get("FORMCAST_NATIVE_ISA")
    return min(best, ISAS.index(asked)) if asked in ISAS else best


def block_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one weight row of ``in_features`` stored as ``qtype``."""
    _, elems, size = BLOCK_TYPES[qtype]
    if in_features % elems:
        raise ValueError(f"{qtype} rows hold whole blocks of {elems}; {in_features} inputs "
                         "do not")
    return in_features // elems * size


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` float32 [M, K] (K a multiple of 32) -> (codes int8 [M, K], scales float32
    [M, K/32]): per block of 32, scale ``amax / 127`` and codes rounded to nearest
    even, exactly as the native kernels quantize their input."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    d = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    return q.reshape(m, k), d


def quant_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: str, *,
                 out: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] float32 times the weight ``blocks`` (uint8 [N, bytes a row], a
    GGUF's rows as stored) transposed -> float32 [M, N].

    Writes into ``out`` when given. Without the extension: ``dense``, the weight
    dequantized to float32 [N, K] (:func:`formcast.engine.loader.dequant.dequantize_rows`),
    is required, and the result is the same product in torch.
    """
    if available():
        if out is None:
            out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
        torch.ops.formcast_native.qmatmul(x, blocks, BLOCK_TYPES[qtype][0], _isa_index(), out)
        return out
    if dense is None:
        raise ValueError("quant_matmul without the native kernels needs the dequantized weight")
    q, d = quantize_activations(x)
    xq = (q.float().view(q.shape[0], -1, 32) * d[..., None]).view(q.shape)
    return torch.mm(xq, dense.t(), out=out) if out is not None else torch.mm(xq, dense.t())


def _load() -> str | None:
    """Build (when not cached) and load the library; the reason it failed, else None."""
    if os.environ.get("FORMCAST_NATIVE", "1") == "0":
        return "turned off by FORMCAST_NATIVE=0"
    if sys.platform != "linux":
        return f"native kernels are built on Linux only, not {sys.platform}"
    try:
        torch.ops.load_library(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return str(exc)
    _state.best_isa = int(torch.ops.formcast_native.isa())
    return None


def _build() -> Path:
    from torch.utils import cpp_extension

    asked = os.environ.get("CXX")
    cxx = shutil.which(asked) if asked else shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        where = f"CXX={asked!r} is not an executable" if asked else "no c++ or g++ on PATH"
        raise OSError(f"no C++ compiler found ({where}); install one (Debian/Ubuntu: "
                      "`apt-get install g++`) or set CXX")
    digest = hashlib.sha256()
    for src in _SOURCES:
        digest.update(src.read_bytes())
    digest.update(f"{torch.__version__} {cxx} {sys.version_info[:2]}".encode())
    key = digest.hexdigest()[:16]
    cache = Path(os.environ.get("FORMCAST_CACHE_DIR", Path.home() / ".cache" / "formcast"))
    path = cache / "native" / f"formcast_qgemm-{key}.so"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libdirs = cpp_extension.library_paths()
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cxx, "-O3", "-std=gnu++20", "-shared", "-fPIC", "-fopenmp", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(_SOURCES[0]), "-o", tmp,
             *[f"-L{d}" for d in libdirs], "-lc10", "-ltorch_cpu",
             *[f"-Wl,-rpath,{d}" for d in libdirs]],
            capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise OSError(f"compiling {_SOURCES[0].name} with {cxx} failed: "
                          f"{done.stderr.strip()[-600:]}")
        os.replace(tmp, path)  # (atomic: another process may build it at once)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def decoder_layer(x: torch.Tensor, pending: torch.Tensor | None, norms: tuple[torch.Tensor, torch.Tensor],
                  eps: float, weights: list[torch.Tensor], qtypes: list[int], counts: list[int],
                  positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_cache: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                  limits: torch.Tensor, *, heads: int, kv_heads: int, scale: float,
                  window: int | None, two_level: int = 0b1111) -> torch.Tensor:
    """One Llama decoder layer's step on the rows of ``x`` [T, E] (float32, updated in
    place and returned, ``pending`` [T, E] added first): RMSNorm and activation
    quantization, q|k|v, RoPE, the new keys and values written to their ``slots`` of
    ``kv_cache`` [2, blocks, block size, Hkv, D], attention of each row over its first
    ``limits[t]`` keys in the blocks ``tables[t]`` (the last ``window`` of them, when
    given), the output projection, then RMSNorm, gate|up, SwiGLU and down, each added
    to the stream. ``weights``: the four projections' block parts in order, ``counts``
    parts each, ``qtypes`` their ggml type ids. ``two_level``: bit i set (projections in
    the order above), projection i's input goes in with more than 8 bits (float32
    activations' greedy tokens): as 16-bit codes where its parts are all Q4_0/Q4_1,
    else as its int8 codes and the int8 codes of their rounding error (about 14
    bits); bit clear, as one set of int8 codes (llama.cpp's Q8 activations). Needs
    :func:`available`."""
    torch.ops.formcast_native.decoder_layer(x, pending, norms[0], norms[1], eps, weights, qtypes,
                                            counts, positions, cos, sin, kv_cache, slots, tables,
                                            limits, heads, kv_heads, scale, window or 0,
                                            two_level, _isa_index())
    return x


def decoder_layers(x: torch.Tensor, norms: list[torch.Tensor], eps: float,
                   weights: list[torch.Tensor], qtypes: list[int], counts: list[int],
                   positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_caches: list[torch.Tensor], slots: torch.Tensor, tables: torch.Tensor,
                   limits: torch.Tensor, *, heads: int, kv_heads: int, scale: float,
                   window: int | None, two_level: int = 0b1111) -> torch.Tensor:
    """:func:`decoder_layer` for every layer of a decoder in one call (nothing pending):
    ``norms`` two a layer, ``counts`` four a layer, ``weights`` and ``qtypes`` every
    layer's parts in layer order, ``kv_caches`` one a layer. Returns ``x``, updated."""
    torch.ops.formcast_native.decoder_layers(x, norms, eps, weights, qtypes, counts, positions,
                                             cos, sin, kv_caches, slots, tables, limits, heads,
                                             kv_heads, scale, window or 0, two_level,
                                             _isa_index())
    return x
