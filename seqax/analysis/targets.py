"""The accelerators that bench/compile_for.py compiles a step for without having one: what each
device is (its figures, each with its source), how the roofline rates it (roofline.Rates), how
JAX's compiler is told about it (a GPU's target description; a TPU's topology name), and how many
devices make a host.

Sources: NVIDIA's datasheets (H100 and H200 SXM; HGX B200) for HBM size and bandwidth, FP32 and FP8
rates and NVLink; XLA's GPU target specs (openxla/xla, xla/backends/gpu/target_config/specs/*.txtpb,
read 2026-12-03) for SM counts, clocks, L2 and the bytes of HBM the driver reports; the CUDA C++
Programming Guide's per-compute-capability limits (threads, registers, shared memory); Google
Cloud's TPU system architecture pages (cloud.google.com/tpu/docs/v5e, v5p, v6e) for HBM, its
bandwidth and ICI (they publish no float8 rate for v5e, v5p or v6e: priced as bf16). Peak bf16 rates are
hardware.py's table.
"""

import dataclasses
import math

from seqax.analysis import hardware
from seqax.analysis.roofline import Rates

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # what --target takes
    platform: str  # JAX's: "cuda" or "tpu"
    device_kind: str  # as jax.Device.device_kind names it (hardware.py's peak table matches it)
    memory_bytes: int  # HBM per device
    memory_bandwidth: float  # HBM bytes/s
    vector_flops: float  # FP32 FLOP/s outside the matrix units
    link_bandwidth: float  # bytes/s one device sends within its host (NVLink) or its slice (ICI), one direction
    network_bandwidth: float  # bytes/s one device sends to other hosts (InfiniBand; TPU: the slice's ICI)
    devices_per_host: int
    sources: str
    # A GPU's description for its compiler: SMs, clock (GHz), L2 bytes, compute capability.
    sm_count: int = 0
    clock_ghz: float = 0.0
    l2_bytes: int = 0
    compute_capability: tuple[int, int] = (0, 0)
    float8_flops: float = 0.0  # dense float8 matmul FLOP/s (0: no float8 units; XLA multiplies it as bf16)
    on_chip_memory_spaces: frozenset[int] = frozenset()  # layouts' S(n) that are not HBM (roofline.Rates)
    host_bandwidth: float = 0.0  # bytes/s between one device and its host's memory, one direction (PCIe)

    @property
    def peak_flops(self) -> float:
        return hardware.peak_bf16_flops_per_device(self.device_kind)

    def rates(self, launch_seconds: float | None = None) -> Rates:
        """The roofline's ceilings for one device of this target. A GPU kernel's launch costs about
        2 us on a stream (NVIDIA's figure for back-to-back launches); a TPU runs one fused program."""
        launch = (2e-6 if self.platform == "cuda" else 0.0) if launch_seconds is None else launch_seconds
        return Rates(self.peak_flops, self.vector_flops, self.memory_bandwidth, self.link_bandwidth,
                     self.network_bandwidth, self.devices_per_host, launch, self.float8_flops,
                     self.on_chip_memory_spaces, self.host_bandwidth)

    def topology(self, devices: int) -> tuple[str, dict]:
        """(topology name, keyword arguments) of jax.experimental.topologies.get_topology_desc for
        `devices` devices of this target: GPUs as hosts of devices_per_host (one host if fewer); TPU
        chips as the smallest slice of that many (v5e, v6e: a 2D torus of 8-chip hosts; v5p: 3D,
        4-chip hosts)."""
        if self.platform == "cuda":
            hosts = max(1, devices // self.devices_per_host)
            if devices > self.devices_per_host and devices % self.devices_per_host:
                raise ValueError(f"{devices} {self.name} GPUs are not whole hosts of {self.devices_per_host}")
            return f"1x{hosts}x{min(devices, self.devices_per_host)}", {}
        if devices & (devices - 1):
            raise ValueError(f"a TPU slice has a power of two of chips, not {devices}")
        if self.name == "v5p":  # 4-chip hosts (2x2x1), slices grown along z, then y, then x
            shape = V5P_SLICES.get(devices)
            if shape is None:
                raise ValueError(f"no v5p slice of {devices} chips here; choose one of {sorted(V5P_SLICES)}")
            return f"v5p:{shape}", {"chips_per_host_bounds": [1, 1, 1] if devices == 1 else [2, 2, 1]}
        rows = 2 ** (int(math.log2(devices)) // 2)
        columns = devices // rows
        return f"{self.name}:{rows}x{columns}", {"chips_per_host_bounds": [min(2, rows), min(4, columns), 1]}

    def gpu_target_config(self) -> str:
        """The GpuTargetConfig text proto that tells JAX's CUDA compiler what GPU to compile for.
        The per-SM limits are those of compute capability 9.x and 10.x (CUDA C++ Programming Guide)."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.memory_bandwidth)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: ACCELERATED_FEATURES }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{self.device_kind}"
"""


V5P_SLICES = {1: "1x1x1", 4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8"}
NVIDIA = ("NVIDIA datasheets (HBM, FP32, NVLink: 900 GB/s both ways = 450 GB/s a direction; NVLink 5 "
          "1.8 TB/s; FP8 Tensor Core, dense = half the sparse figure: H100 and H200 SXM 3,958 TFLOPS sparse, "
          "HGX B200 9 PFLOPS sparse a GPU); one 400 Gb/s InfiniBand NDR adapter per GPU across hosts "
          "(DGX H100/H200/B200); XLA's GPU target specs (SMs, clock, L2, HBM bytes)")
TPU = "Cloud TPU system architecture pages: HBM, its bandwidth, ICI Gbps per chip (both ways, halved here)"
# The memory spaces of a TPU program's layouts that are on the chip, as libtpu's optimized HLO writes them:
# S(1) the TensorCore's VMEM (memory-space assignment puts a value there, or prefetches it with a
# copy-start), S(2) the u32 flags an asynchronous collective waits on, S(6) scalars (loop counters).
# An array with no S(n) is in HBM; S(5) is the host's memory.
TPU_ON_CHIP = frozenset({1, 2, 6})
# A device's link to its host's memory, one direction: PCIe x16 at 32 GT/s (Gen5) or 16 GT/s (Gen4), 128b/130b
# coded. NVIDIA's datasheets give H100, H200 and B200 PCIe Gen5 x16; Google's v6e page says PCIe Gen5 and
# its v5e and v5p pages say nothing: x16, and Gen4 for v5e and v5p, are assumed.
PCIE5_X16 = 32e9 * 16 / 8 * 128 / 130
PCIE4_X16 = PCIE5_X16 / 2

TARGETS = {t.name: t for t in [
    Target("h100", "cuda", "NVIDIA H100 80GB HBM3", memory_bytes=84_942_979_072, memory_bandwidth=3.35e12,
           vector_flops=67e12, link_bandwidth=450 * GB, network_bandwidth=50 * GB, devices_per_host=8,
           sources=NVIDIA, host_bandwidth=PCIE5_X16, sm_count=132, clock_ghz=1.98, l2_bytes=52_428_800,
           compute_capability=(9, 0), float8_flops=1979e12),
    Target("h200", "cuda", "NVIDIA H200", memory_bytes=151_397_597_184, memory_bandwidth=4.8e12,
           vector_flops=67e12, link_bandwidth=450 * GB, network_bandwidth=50 * GB, devices_per_host=8,
           sources=NVIDIA, host_bandwidth=PCIE5_X16, sm_count=132, clock_ghz=1.98, l2_bytes=52_428_800,
           compute_capability=(9, 0), float8_flops=1979e12),
    Target("b200", "cuda", "NVIDIA B200", memory_bytes=191_514_411_008, memory_bandwidth=7.672e12,
           vector_flops=80e12, link_bandwidth=900 * GB, network_bandwidth=50 * GB, devices_per_host=8,
           sources=NVIDIA, host_bandwidth=PCIE5_X16, sm_count=148, clock_ghz=1.965, l2_bytes=132_644_864,
           compute_capability=(10, 0), float8_flops=4500e12),
    # TPUs: no published vector rate; taken at 1/16 of the matrix rate, as on the GPUs above. Their
    # elementwise kernels are bound by HBM bandwidth long before.
    Target("v5e", "tpu", "TPU v5 lite", memory_bytes=16 * 2**30, memory_bandwidth=819 * GB,
           vector_flops=197e12 / 16, link_bandwidth=100 * GB, network_bandwidth=100 * GB, devices_per_host=8,
           sources=TPU, on_chip_memory_spaces=TPU_ON_CHIP, host_bandwidth=PCIE4_X16),
    Target("v5p", "tpu", "TPU v5", memory_bytes=95 * 2**30, memory_bandwidth=2765 * GB,
           vector_flops=459e12 / 16, link_bandwidth=300 * GB, network_bandwidth=300 * GB, devices_per_host=4,
           sources=TPU, on_chip_memory_spaces=TPU_ON_CHIP, host_bandwidth=PCIE4_X16),
    Target("v6e", "tpu", "TPU v6 lite", memory_bytes=32 * 2**30, memory_bandwidth=1640 * GB,
           vector_flops=918e12 / 16, link_bandwidth=224 * GB, network_bandwidth=224 * GB, devices_per_host=8,
           sources=TPU, on_chip_memory_spaces=TPU_ON_CHIP, host_bandwidth=PCIE5_X16),
]}


def target_for(device_kind: str) -> Target | None:
    """The target whose device_kind `device_kind` is (a real device may add to the name: "NVIDIA
    H200 141GB HBM3e"), the longest such name first ("TPU v5 lite" before "TPU v5"); None if none."""
    matches = [t for t in TARGETS.values() if device_kind.startswith(t.device_kind)]
    return max(matches, key=lambda t: len(t.device_kind), default=None)
