"""benchmarks/prefill_precision.py --profile: kernels are counted in the product whose GPU range holds their
start, against the kernels' total (a range's own span, gaps included, is not a product's time)."""

from __future__ import annotations

from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from tests.benchmark_scripts import load


def _event(name: str, start: int, end: int, device: DeviceType = DeviceType.CUDA) -> FunctionEvent:
    return FunctionEvent(id=0, name=name, thread=0, start_us=start, end_us=end, device_type=device)


def test_kernels_are_counted_in_the_range_holding_them() -> None:
    events = [
        _event("moe_linear 256x1024 Q4_K (512,)", 100, 400),  # a GPU range: its span (300 us) has gaps
        _event("moe_linear 256x1024 Q4_K (512,)", 90, 95, DeviceType.CPU),  # its CPU copy: ignored
        _event("_gemm_kernel", 100, 180),
        _event("sort", 200, 210),
        _event("_gemm_kernel", 300, 390),
        _event("linear 2048 Q4_K (512,)", 500, 600),
        _event("_gemm_kernel", 510, 560),
        _event("sdpa", 700, 740),  # outside every range: counted in the total only
    ]
    table = load("prefill_precision").product_table(events).splitlines()
    rows = {line[:60].strip(): line[60:].split() for line in table[1:]}
    assert rows["moe_linear 256x1024 Q4_K (512,)"] == ["3", "0.18", "66.7%"]  # 80 + 10 + 90 of 270 us
    assert rows["linear 2048 Q4_K (512,)"] == ["1", "0.05", "18.5%"]
    assert rows["all kernels"] == ["5", "0.27"]
