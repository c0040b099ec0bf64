"""hardware.py: the peak bf16 FLOP/s of each device kind that MFU divides by."""

import pytest

from seqax.analysis import hardware


@pytest.mark.parametrize(
    "kind,peak",
    [("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
     ("NVIDIA H200", 989e12), ("NVIDIA B200", 2250e12), ("TPU v4", 275e12), ("TPU v5 lite", 197e12),
     ("TPU v5", 459e12), ("TPU v5p", 459e12), ("TPU v6 lite", 918e12), ("TPU v4 lite", None), ("Imaginary X1", None)],
)
def test_peak_table(kind, peak):
    assert hardware.peak_bf16_flops_per_device(kind) == peak
