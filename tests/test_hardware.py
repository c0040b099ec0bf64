"""hardware.py: the peak bf16 FLOP/s of each device kind that MFU divides by, and this CPU's, kept."""

import datetime
import json

import jax
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


def test_the_cpu_peak_is_measured_once_per_machine_and_kept(tmp_path, monkeypatch):
    """MFU compares between runs because every run on a machine divides by the same figure: the first
    measures it and keeps it (with how and when); the next read it, and do not measure."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []
    monkeypatch.setattr(hardware, "measure_machine_matmul_flops", lambda: measured.append(1) or 2.5e11)
    first, second = hardware.peak_flops(), hardware.peak_flops()
    assert len(measured) == 1 and first[0] == second[0] == 2.5e11
    assert first[1].startswith("this CPU's best matmul on all cores (measured now, kept in ")
    assert second[1].startswith("this CPU's best matmul on all cores (20")  # its date
    kept = json.loads((tmp_path / "seqax" / "cpu_peak.json").read_text())
    assert kept == {hardware.this_machine(): {"flop_per_second": 2.5e11, "how": "best matmul on all cores",
                                              "when": datetime.date.today().isoformat()}}


def test_a_cpu_peak_that_cannot_be_kept_is_measured_and_says_why(tmp_path, monkeypatch):
    (tmp_path / "seqax").write_text("a file where the folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(hardware, "measure_machine_matmul_flops", lambda: 2.5e11)
    peak, source = hardware.peak_flops()
    assert peak == 2.5e11 and "not kept: cannot write " in source and "cpu_peak.json" in source, source


def test_the_measured_cpu_peak_is_a_real_rate():
    """One matmul on this machine's CPU, measured where a run measures it (its mesh of every device set):
    a rate between a slow core's and a large server's."""
    with jax.set_mesh(jax.make_mesh((jax.device_count(),), ("d",))):
        assert 1e9 < hardware.measure_machine_matmul_flops((512,), repeats=2) < 1e14
