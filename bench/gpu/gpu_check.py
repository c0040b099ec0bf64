"""Whether this Python can run bench/throughput.py on a GPU; bench/gpu/gpu.sh runs it first, so that
a machine that cannot run the benchmark says why within seconds. Prints the devices and exits 0,
or prints one line naming what is missing and how to fix it and exits 1.

    python3 -m bench.gpu.gpu_check [--allow-cpu] [--wheels-dir .whl]

Checked in this order: jax imports and is new enough; every module the benchmark imports is
there; JAX's backend is a GPU (--allow-cpu accepts a CPU: the tests run bench/gpu/gpu.sh on CPU).
"""

import argparse
import os
import re
import sys

# The oldest jax that seqax is tested with (0.10.2, on CPU; the lent H200 machine has 0.11.2, which
# ran the benchmarks and tests/test_gpu.py there on 2026-12-04). The code needs jax.shard_map with
# check_vma, jax.set_mesh, lax.pcast and explicit mesh axis types.
MIN_JAX = (0, 10)

# pip's name for a module whose package is named differently.
PACKAGE_OF_MODULE = {"hydra": "hydra-core", "google_crc32c": "google-crc32c", "antlr4": "antlr4-python3-runtime",
                     "yaml": "PyYAML", "ml_dtypes": "ml-dtypes"}


class Missing(Exception):
    """Something the benchmark needs is not there; the message says what and how to fix it."""


def wheels_advice(wheels_dir: str) -> str:
    if not os.path.isdir(wheels_dir):
        return (f"the wheels folder {wheels_dir} is absent: run `bash bench/gpu/gpu_wheels.sh` "
                f"where pip reaches PyPI and carry {wheels_dir} with the working tree (bench/gpu/gpu.sh installs it)")
    return (f"it is not among the wheels in {wheels_dir}: add it to bench/gpu/gpu_wheels.sh's list, "
            f"run that again and carry {wheels_dir}")


def check_jax():
    try:
        import jax
    except ImportError as e:
        raise Missing(f"jax does not import in {sys.executable} ({e}): "
                      "run this with a Python that has jax and its CUDA plugin (set PYTHON)") from None
    version = tuple(int(part) for part in re.findall(r"\d+", jax.__version__)[:2])
    if version < MIN_JAX:
        raise Missing(f"jax {jax.__version__} is too old: seqax needs jax >= {'.'.join(map(str, MIN_JAX))} "
                      "(tested with 0.10.2 on CPU; written for 0.11.2 on the GPU machine too); "
                      "install a newer jax with its CUDA plugin")
    return jax


def check_modules(wheels_dir: str):
    """Imports everything the benchmark's child processes import."""
    try:
        import bench.measure_step  # noqa: F401
    except ImportError as e:
        module = (e.name or "").split(".")[0]
        if not module:
            raise Missing(f"an import failed: {e}; {wheels_advice(wheels_dir)}") from None
        package = PACKAGE_OF_MODULE.get(module, module)
        raise Missing(f"Python package {package} (module {module}) is missing for {sys.executable}: "
                      f"{wheels_advice(wheels_dir)}") from None


def check_backend(jax, allow_cpu: bool) -> str:
    backend = jax.default_backend()
    devices = f"{jax.device_count()} x {jax.devices()[0].device_kind} ({backend})"
    if backend != "gpu" and not (allow_cpu and backend == "cpu"):
        raise Missing(f"no GPU visible to JAX: its devices are {devices}; "
                      "check nvidia-smi and CUDA_VISIBLE_DEVICES, and that jax's "
                      "CUDA plugin (jax-cuda13-plugin or jax-cuda12-plugin, matching the driver) is installed")
    return f"{devices}, jax {jax.__version__}, Python {sys.version.split()[0]}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--allow-cpu", action="store_true", help="accept a CPU backend")
    parser.add_argument("--wheels-dir", default=".whl", help="where the carried wheels are (named in the advice)")
    args = parser.parse_args(argv)
    try:
        jax = check_jax()
        check_modules(args.wheels_dir)
        print(check_backend(jax, args.allow_cpu), flush=True)
    except Missing as e:
        print(e, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
