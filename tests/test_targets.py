"""targets.py: each target's topology for a device count, its rates, and a real device's kind
mapped to its target (as bench/measure_step.py does on a lent GPU)."""

import pytest

from seqax.analysis.targets import TARGETS, target_for


@pytest.mark.parametrize("name,devices,topology", [
    ("h200", 1, "1x1x1"), ("h200", 8, "1x1x8"), ("h200", 128, "1x16x8"),
    ("v6e", 8, "v6e:2x4"), ("v6e", 128, "v6e:8x16"), ("v5e", 4, "v5e:2x2"),
    ("v5p", 8, "v5p:2x2x2"), ("v5p", 64, "v5p:4x4x4"), ("v5p", 128, "v5p:4x4x8"),
])
def test_a_device_count_is_a_topology_of_whole_hosts(name, devices, topology):
    assert TARGETS[name].topology(devices)[0] == topology


@pytest.mark.parametrize("name,devices", [("h200", 12), ("v6e", 12), ("v5p", 2)])
def test_a_count_no_slice_has_is_refused(name, devices):
    with pytest.raises(ValueError):
        TARGETS[name].topology(devices)


@pytest.mark.parametrize("kind,name", [("NVIDIA H200", "h200"), ("NVIDIA H200 141GB HBM3e", "h200"),
                                       ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA B200", "b200"),
                                       ("TPU v5 lite", "v5e"), ("TPU v5", "v5p"), ("TPU v6 lite", "v6e"),
                                       ("cpu", None), ("NVIDIA A100-SXM4-80GB", None)])
def test_a_device_kind_is_its_target(kind, name):
    assert getattr(target_for(kind), "name", None) == name


def test_every_target_has_its_peak_and_a_gpu_its_description():
    for target in TARGETS.values():
        rates = target.rates()
        assert rates.matmul_flops == target.peak_flops > rates.vector_flops > 0
        assert target.memory_bytes > 15 * 2**30 and target.memory_bandwidth > 0.5e12
        if target.platform == "cuda":
            text = target.gpu_target_config()
            assert f"core_count: {target.sm_count}" in text and f'"{target.device_kind}"' in text
