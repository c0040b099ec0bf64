"""What the devices can do: each accelerator's peak dense bfloat16 matmul rate (the denominator of
MFU), this CPU's measured one, and the links between devices, each figure with its source.
"""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from seqax.console import warn

# Peak dense bfloat16 matmul rate per device, by jax.Device.device_kind (first full match).
# Vendors quote "with sparsity" figures for NVIDIA parts: the dense rate is half of those.
PEAK_BF16_FLOPS = [
    # NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity), SXM and PCIe.
    (r"NVIDIA A100.*", 312e12),
    # NVIDIA H100 datasheet: BF16 1,979 (SXM) / 1,671 (NVL) / 1,513 (PCIe) TFLOPS with sparsity.
    (r"NVIDIA H100.*PCIe.*", 756e12),
    (r"NVIDIA H100.*NVL.*", 835e12),
    (r"NVIDIA H100.*", 989e12),
    # NVIDIA H200 datasheet: BF16 1,979 (SXM) / 1,671 (NVL) TFLOPS with sparsity.
    (r"NVIDIA H200.*NVL.*", 835e12),
    (r"NVIDIA H200.*", 989e12),
    # NVIDIA HGX B200 datasheet: FP16/BF16 4.5 PFLOPS per GPU with sparsity.
    (r"NVIDIA B200.*", 2250e12),
    # Google Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e):
    # peak bf16 TFLOPS per chip. JAX names v5e "TPU v5 lite", v5p "TPU v5", v6e "TPU v6 lite".
    (r"TPU v4", 275e12),
    (r"TPU v5 lite|TPU v5e", 197e12),
    (r"TPU v5p?", 459e12),
    (r"TPU v6 lite|TPU v6e", 918e12),
]


def peak_bf16_flops_per_device(device_kind: str) -> float | None:
    return next((peak for pattern, peak in PEAK_BF16_FLOPS if re.fullmatch(pattern, device_kind)), None)


def measure_cpu_matmul_flops(n: int = 1024, repeats: int = 3) -> float:
    """The whole machine's peak matmul rate (FLOP/s), the denominator of CPU MFU: every local
    device multiplies its own n x n matrices at once, as in training, so simulated devices that
    share cores are measured sharing them; the best of `repeats` runs of bf16 x bf16 -> f32 (the
    model's matmuls) and f32 x f32 (faster on some CPUs). The best, not a typical run: a peak is
    what no step can beat, and another process busy on the cores only slows a run down."""
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("all",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("all"))
    best = float("inf")
    with jax.set_mesh(mesh):  # its own mesh, whatever mesh the caller has set
        for dtype in (jnp.bfloat16, jnp.float32):
            # From host memory: jnp.ones would follow the caller's mesh, which spans other processes.
            a = jax.device_put(np.ones((len(devices) * n, n), dtype), sharding)
            matmul = jax.jit(jax.shard_map(lambda x: jnp.matmul(x, x[:n].T, preferred_element_type=jnp.float32),
                                           mesh=mesh, in_specs=jax.sharding.PartitionSpec("all"),
                                           out_specs=jax.sharding.PartitionSpec("all")))
            matmul(a).block_until_ready()
            for _ in range(repeats):
                start = time.perf_counter()
                matmul(a).block_until_ready()
                best = min(best, time.perf_counter() - start)
    return len(devices) * 2 * n**3 / best


def peak_flops() -> tuple[float | None, str]:
    """Peak bf16 FLOP/s of all devices of the run and where the number comes from. On CPU it is
    measured (each process measures its machine); an unknown accelerator gives None and one
    warning, never a guess."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        rate = measure_cpu_matmul_flops() * jax.process_count()
        return rate, (f"measured peak matmul rate of {jax.process_count()} CPU machine(s) (raised to any step's "
                      "model FLOP/s that exceeds it)")
    per_device = peak_bf16_flops_per_device(device.device_kind)
    if per_device is None:
        warn(f"no peak bf16 FLOP/s known for device kind {device.device_kind!r}: MFU is logged as null; "
             "add the device to seqax/analysis/hardware.py's PEAK_BF16_FLOPS")
        return None, f"unknown ({device.device_kind})"
    return (per_device * jax.device_count(),
            f"{jax.device_count()} x {device.device_kind} at {per_device / 1e12:.0f} TFLOP/s")


# Per-device link bandwidth, one direction, bytes/s: what a device can send while all send.
LINK_BANDWIDTH = [
    # NVIDIA H100/H200 SXM: NVLink 4, 18 links x 25 GB/s per direction = 450 GB/s (900 GB/s both ways).
    ("NVLink 4 (H100/H200 SXM, within a node)", 450e9),
    # NVIDIA A100 SXM: NVLink 3, 12 links x 25 GB/s per direction = 300 GB/s.
    ("NVLink 3 (A100 SXM, within a node)", 300e9),
    # One 400 Gb/s InfiniBand NDR adapter per GPU (DGX H100): 50 GB/s per direction.
    ("InfiniBand NDR 400 Gb/s per GPU (between nodes)", 50e9),
    # Google Cloud TPU v5p: ICI 4,800 Gbps per chip (both ways, all links) = 300 GB/s per direction.
    ("TPU v5p ICI", 300e9),
]
