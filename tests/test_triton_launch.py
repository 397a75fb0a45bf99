"""``runtime.backends.triton_launch.launch``: the compiled kernel started directly must be the one Triton's
own entry would pick (argument alignment, integers equal to 1 or divisible by 16, constexprs), on the
current stream. Marked ``gpu`` (the fast path exists on CUDA only; elsewhere ``launch`` is ``kernel[grid]``)."""

from __future__ import annotations

import pytest
import torch

from runtime.backends import triton_launch
from runtime.backends.triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        triton is None or triton_launch.JITFunction is None or not torch.cuda.is_available(),
        reason="needs CUDA and triton",
    ),
]


@pytest.fixture(autouse=True)
def _direct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_launch, "DIRECT", True)  # whatever FORGE_TRITON_DIRECT says


if triton is not None:

    @triton.jit
    def _axpy_kernel(x, y, out, n, a, stride, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        v = tl.load(x + i * stride, mask=m) * a + tl.load(y + i, mask=m)
        if SQUARE:
            v = v * v
        tl.store(out + i, v, mask=m)


def _axpy(x: torch.Tensor, y: torch.Tensor, a: float, square: bool = False) -> torch.Tensor:
    n = y.numel()
    out = torch.empty_like(y)
    launch(_axpy_kernel, (-(-n // 128),), x, y, out, n, a, x.stride(0), BLOCK=128, SQUARE=square)
    return out


def _expected(x: torch.Tensor, y: torch.Tensor, a: float, square: bool = False) -> torch.Tensor:
    v = x[: y.numel()] * a + y
    return v * v if square else v


def test_no_launch_hook_is_set() -> None:
    """The direct path is taken (Triton's empty hook chains are not hooks)."""
    assert not triton_launch._hooked(triton_launch.knobs.runtime.launch_enter_hook)
    assert not triton_launch._hooked(triton_launch.knobs.runtime.launch_exit_hook)
    assert triton_launch._hooked(lambda metadata: None)


def _entries() -> int:
    return sum(key[0] is _axpy_kernel for key in triton_launch._compiled)


def test_launch_reuses_the_compiled_kernel_of_a_specialization() -> None:
    triton_launch.clear()
    g = torch.Generator(device="cuda").manual_seed(0)
    x, y = torch.randn(1000, device="cuda", generator=g), torch.randn(1000, device="cuda", generator=g)
    for _ in range(3):
        torch.testing.assert_close(_axpy(x, y, 0.5), _expected(x, y, 0.5), rtol=0, atol=1e-6)
    assert _entries() == 1
    x2, y2 = torch.randn(1024, device="cuda", generator=g), torch.randn(1024, device="cuda", generator=g)
    torch.testing.assert_close(_axpy(x2, y2, -2.0), _expected(x2, y2, -2.0), rtol=0, atol=1e-5)
    assert _entries() == 2  # 1,024 is divisible by 16, 1,000 is not: Triton specializes on that


def test_launch_specializes_as_triton_does() -> None:
    """Views 4 bytes past an aligned address, a count of 1, a strided input and another constexpr each take
    their own compiled kernel, and every result is right (a kernel compiled for aligned or unit-stride
    arguments would read the wrong values or fault)."""
    triton_launch.clear()
    g = torch.Generator(device="cuda").manual_seed(1)
    base = torch.randn(4097, device="cuda", generator=g)
    y = torch.randn(4096, device="cuda", generator=g)
    cases = [
        (base[:4096], y, False),
        (base[1:], y, False),  # not 16-byte aligned
        (base[1:], y[1:].clone(), False),  # 4,095 values
        (base[:1], y[:1].clone(), False),  # n == 1
        (base[::2], y[:2048].clone(), False),  # stride 2
        (base[:4096], y, True),
    ]
    for x, yy, square in cases:
        for _ in range(2):  # the first launch compiles through Triton's entry, the second is the direct one
            torch.testing.assert_close(
                _axpy(x, yy, 1.5, square), _expected(x, yy, 1.5, square), rtol=0, atol=1e-4
            )
    assert _entries() >= 5


def test_launch_runs_on_the_current_stream() -> None:
    """On a side stream held up by a sleep, the launch must see the copy queued before it there (a launch on
    the default stream would run at once, on the old values)."""
    x_old, x_new, y = (torch.randn(1 << 16, device="cuda") for _ in range(3))
    x = x_old.clone()
    _axpy(x, y, 3.0)  # compiled and remembered
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x.copy_(x_new)
        out = _axpy(x, y, 3.0)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, _expected(x_new, y, 3.0), rtol=0, atol=1e-5)


def test_launch_is_captured_in_a_cuda_graph() -> None:
    x = torch.randn(4096, device="cuda")
    y = torch.randn(4096, device="cuda")
    out = torch.empty_like(y)
    launch(_axpy_kernel, (32,), x, y, out, 4096, 2.0, 1, BLOCK=128, SQUARE=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(_axpy_kernel, (32,), x, y, out, 4096, 2.0, 1, BLOCK=128, SQUARE=False)
    x.copy_(torch.randn(4096, device="cuda"))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 2.0 + y, rtol=0, atol=1e-5)
