"""FastLaunch's bookkeeping, on a stand-in for a Triton kernel: the first launch
of each key goes the ordinary way, the next ones straight to the compiled
kernel's launcher with every argument in signature order."""

from __future__ import annotations

import pytest
import torch

triton_launch = pytest.importorskip("formcast.engine.kernels.triton_launch")


class Compiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, *args):
        self.log.append(("direct", args))


class Kernel:
    """What FastLaunch reads of a ``@triton.jit`` function."""

    arg_names = ["x_ptr", "n", "BLOCK", "y_ptr"]
    __name__ = "kernel"

    def __init__(self):
        self.log, self.compiled = [], {}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("ordinary", grid, args, kwargs))
            return Compiled(self.log)
        return launch


@pytest.fixture
def launch(monkeypatch):
    monkeypatch.setattr(triton_launch, "supported", lambda: True)
    monkeypatch.setattr(triton_launch, "hooks_set", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    kernel = Kernel()
    fast = triton_launch.FastLaunch.__new__(triton_launch.FastLaunch)
    fast.fn, fast.options, fast.kernels, fast.direct = kernel, {"num_warps": 4}, {}, 0
    fast.names = list(kernel.arg_names)
    return fast, kernel


def test_the_first_launch_of_a_key_is_ordinary_then_direct_in_signature_order(launch):
    fast, kernel = launch
    x, y = torch.zeros(8), torch.zeros(8)
    fast((3,), x, 32, y, BLOCK=64)
    assert kernel.log[-1] == ("ordinary", (3,), (x, 32, y), {"BLOCK": 64, "num_warps": 4})
    x2, y2 = torch.ones(8), torch.ones(8)
    fast((5, 2), x2, 48, y2, BLOCK=64)  # (same dtypes, alignment, integer kind)
    kind, args = kernel.log[-1]
    assert kind == "direct" and args[:4] == (5, 2, 1, 77) and args[4:7] == ("fn", "meta", None)
    assert args[9:] == (x2, 48, 64, y2) and fast.direct == 1


@pytest.mark.parametrize("change", ["one", "unaligned", "odd", "dtype", "constexpr", "wide"])
def test_what_triton_specializes_on_makes_a_new_key(launch, change):
    fast, kernel = launch
    x, y = torch.zeros(8), torch.zeros(8)
    fast((3,), x, 32, y, BLOCK=64)
    other = {"one": ((x, 1, y), 64), "unaligned": ((x[1:], 32, y), 64), "odd": ((x, 33, y), 64),
             "dtype": ((x.double(), 32, y), 64), "constexpr": ((x, 32, y), 128),
             "wide": ((x, 2**40, y), 64)}[change]
    fast((3,), *other[0], BLOCK=other[1])
    assert kernel.log[-1][0] == "ordinary" and fast.direct == 0


def test_a_direct_launch_that_fails_goes_the_ordinary_way(launch):
    fast, kernel = launch
    x, y = torch.zeros(8), torch.zeros(8)
    fast((3,), x, 32, y, BLOCK=64)
    (compiled,) = fast.kernels.values()
    compiled.run = lambda *args: (_ for _ in ()).throw(RuntimeError("launcher"))
    fast((3,), x, 32, y, BLOCK=64)
    assert kernel.log[-1][0] == "ordinary" and fast.direct == 0
    fast((3,), x, 32, y, BLOCK=64)  # (the variant found again: direct from then on)
    assert kernel.log[-1][0] == "direct" and fast.direct == 1


def test_wrong_argument_counts_raise(launch):
    fast, _ = launch
    x = torch.zeros(8)
    with pytest.raises(TypeError, match="too few"):
        fast((1,), x, 32, BLOCK=64)
    with pytest.raises(TypeError, match="too many"):
        fast((1,), x, 32, x, x, BLOCK=64)


def test_this_tritons_launch_is_the_one_fast_launch_copies():
    """The installed Triton (if any) launches as FastLaunch expects; a kernel run
    by the interpreter is launched the ordinary way."""
    pytest.importorskip("triton")
    assert triton_launch.supported()


def test_empty_hook_chains_count_as_no_hooks():
    """Triton keeps its launch hooks as chains, empty unless a profiler adds one
    (older Tritons: a plain callable or None)."""
    knobs = pytest.importorskip("triton.knobs")
    runtime = knobs.runtime
    assert not triton_launch.hooks_set()

    def hook(*args) -> None:
        pass

    chain = runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        runtime.launch_enter_hook = hook
    try:
        assert triton_launch.hooks_set()
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            runtime.launch_enter_hook = chain
    assert not triton_launch.hooks_set()
    assert not triton_launch.hook_set(None) and triton_launch.hook_set(print)
