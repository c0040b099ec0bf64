"""What the devices can do: each accelerator's peak dense bfloat16 matmul rate (the denominator of
MFU), this CPU's measured one, and the links between devices, each figure with its source.

A CPU has no datasheet rate that XLA reaches, so its peak is measured, once per machine, and kept
(cpu_peak.json in the user's cache directory): every run on the machine divides by the same figure,
so that MFU compares between runs. A step that beats it raises it, there too.
"""

import datetime
import json
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import jaxlib
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


def measure_machine_matmul_flops(sizes: tuple[int, ...] = (1024, 2048), repeats: int = 8) -> float:
    """This machine's best matmul rate (FLOP/s): n x n matmuls on one CPU device, which XLA spreads over all
    the cores, of each size, bf16 x bf16 -> f32 (the model's matmuls) and f32 x f32 (faster on some CPUs),
    the best of `repeats` runs of each: a peak is what no step beats, and another process busy on the
    cores only slows a run down."""
    device, best = jax.local_devices()[0], 0.0
    with jax.set_mesh(jax.sharding.Mesh(np.array([device]), ("one",))):  # its own, whatever mesh the caller has set
        for n in sizes:
            for dtype in (jnp.bfloat16, jnp.float32):
                a = jax.device_put(np.ones((n, n), dtype), device)
                matmul = jax.jit(lambda x: jnp.matmul(x, x.T, preferred_element_type=jnp.float32))
                matmul(a).block_until_ready()
                for _ in range(repeats):
                    start = time.perf_counter()
                    matmul(a).block_until_ready()
                    best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


MEASURED = "best matmul on all cores"


def cpu_peak_file() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "seqax", "cpu_peak.json")


def _shown(path: str) -> str:
    home = os.path.expanduser("~").rstrip(os.sep) + os.sep
    return "~" + os.sep + path[len(home):] if path.startswith(home) else path


def this_machine() -> str:
    """What a kept CPU peak is for: the processor, the cores this process may use, and jaxlib (whose
    kernels do the matmuls)."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:  # not Linux
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores, jaxlib {jaxlib.__version__}"


def _kept() -> dict:
    try:
        with open(cpu_peak_file()) as f:
            kept = json.load(f)
        return kept if isinstance(kept, dict) else {}
    except (OSError, ValueError):
        return {}


def keep_cpu_peak(flops: float, how: str) -> str:
    """Keeps `flops` as this machine's CPU peak, measured `how`; returns where (or why not: a peak that
    cannot be kept is this run's only)."""
    path, kept = cpu_peak_file(), _kept()
    kept[this_machine()] = {"flop_per_second": flops, "how": how, "when": datetime.date.today().isoformat()}
    temporary = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), prefix=".cpu_peak.", delete=False) as f:
            temporary = f.name
            json.dump(kept, f, indent=1)
        os.replace(temporary, path)  # whole or not at all, if two runs keep theirs at once
    except OSError as e:
        if temporary and os.path.exists(temporary):
            os.remove(temporary)
        return f"not kept: cannot write {_shown(path)}: {e.strerror or e}"
    return f"kept in {_shown(path)}"


def cpu_peak() -> tuple[float, str]:
    """This machine's CPU peak (FLOP/s) and where it comes from: the kept figure, else measured now and kept."""
    entry = _kept().get(this_machine())
    if isinstance(entry, dict) and isinstance(entry.get("flop_per_second"), int | float):
        return (entry["flop_per_second"],
                f"this CPU's {entry.get('how')} ({entry.get('when')}, kept in {_shown(cpu_peak_file())})")
    flops = measure_machine_matmul_flops()
    return flops, f"this CPU's {MEASURED} (measured now, {keep_cpu_peak(flops, MEASURED)})"


def peak_flops() -> tuple[float | None, str]:
    """Peak bf16 FLOP/s of all devices of the run and where the number comes from. On CPU it is this
    machine's kept peak (cpu_peak), times the processes (each on a machine like this one); an unknown
    accelerator gives None and one warning, never a guess."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        rate, source = cpu_peak()
        machines = f"{jax.process_count()} machines x " if jax.process_count() > 1 else ""
        return rate * jax.process_count(), machines + source
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
