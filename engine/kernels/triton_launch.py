"""A Triton kernel's launches straight through its compiled kernel's launcher.

``kernel[grid](*args)`` binds the arguments, works out what the kernel is
specialized on and looks the compiled variant up at every launch: tens of
microseconds of Python a launch of the masked-argmax kernel, which a JSON run
launches outside the decode graphs at each step that has masked rows.
:class:`FastLaunch` finds the compiled variant by one ordinary launch per key of
its own, then launches it as Triton's own ``run`` does, without the rest (the
launcher's own argument checks, pinned pointers among them, stay).

The key is a superset of what Triton specializes a variant on: each tensor's
dtype, device kind and 16-byte alignment, each integer's type, whether it is 1,
its divisibility by 16 and its width, every other argument's value (the
constexprs among them), the launch options and the device. Arguments that
differ only where Triton does not look (a pointer's address, an integer's
value) share a variant, as they do in Triton's cache.

Used only where Triton's ``JITFunction.run`` launches as this module knows
(checked in its source: the compiled kernel's ``run`` with the grid, the raw
stream, the kernel's function and packed metadata, the launch hooks and every
bound argument in signature order), with no launch hooks set (a profiler's;
Triton keeps empty hook chains, which count as none);
otherwise, or when a direct launch raises, launches go the ordinary way.
"""

from __future__ import annotations

import functools
import inspect

import torch

_CALL = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, "
         "launch_metadata,")


@functools.cache
def supported() -> bool:
    """Whether this Triton's ``JITFunction.run`` launches the way :class:`FastLaunch` does."""
    try:
        from triton.runtime.jit import JITFunction

        src = " ".join(inspect.getsource(JITFunction.run).split())
    except Exception:
        return False
    return _CALL in src and "*bound_args.values())" in src and \
        "bound_args, specialization, options = binder(*args, **kwargs)" in src


def hook_set(hook) -> bool:
    """Whether a launch hook is there to call (Triton keeps empty hook chains)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


def hooks_set() -> bool:
    """Whether a profiler set a launch hook (FastLaunch then launches the ordinary way)."""
    from triton import knobs

    runtime = knobs.runtime
    return hook_set(runtime.launch_enter_hook) or hook_set(runtime.launch_exit_hook)


def _arg_key(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.is_cuda, not value.data_ptr() & 15)
    if type(value) is int:
        return (int, value == 1, not value & 15,
                -2**31 <= value < 2**31, 2**63 <= value < 2**64)
    return (type(value), value)


class FastLaunch:
    """Launches of the Triton kernel ``fn`` (a ``@triton.jit`` function) with
    the launch options ``options`` (``num_warps`` and the like): ``launch(grid,
    *args, **constexprs)`` as ``fn[grid](*args, **constexprs, **options)``."""

    def __init__(self, fn, **options) -> None:
        self.fn = fn
        self.options = options
        self.kernels: dict[tuple, object] = {}
        self.direct = 0  # launches made straight through the launcher
        try:  # (under TRITON_INTERPRET the kernel is an interpreted function: ordinary launches)
            from triton.runtime.jit import JITFunction

            self.names = list(fn.arg_names) if isinstance(fn, JITFunction) else None
        except Exception:
            self.names = None

    def __call__(self, grid: tuple[int, ...], *args, **constexprs) -> None:
        if self.names is None or not supported() or hooks_set():
            self.fn[grid](*args, **constexprs, **self.options)
            return
        rest = iter(args)
        try:
            values = [constexprs[name] if name in constexprs else next(rest)
                      for name in self.names]
        except StopIteration:
            raise TypeError(f"{self.fn.__name__}: too few arguments") from None
        if next(rest, rest) is not rest:
            raise TypeError(f"{self.fn.__name__}: too many arguments")
        device = torch.cuda.current_device()
        key = (device, *(("constexpr", v) if name in constexprs else _arg_key(v)
                         for name, v in zip(self.names, values)))
        kernel = self.kernels.get(key)
        if kernel is not None:
            try:
                kernel.run(grid[0], grid[1] if len(grid) > 1 else 1,
                           grid[2] if len(grid) > 2 else 1,
                           torch._C._cuda_getCurrentRawStream(device), kernel.function,
                           kernel.packed_metadata, None, None, None, *values)
                self.direct += 1
                return
            except Exception:
                del self.kernels[key]  # (found again by the ordinary launch below)
        kernel = self.fn[grid](*args, **constexprs, **self.options)
        if kernel is not None and hasattr(kernel, "packed_metadata") and \
                not hasattr(kernel, "result"):
            self.kernels[key] = kernel
