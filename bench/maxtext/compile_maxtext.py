"""MaxText's own training step compiled for a TPU slice or GPUs that are not here: the anchor that our roofline
prices beside our step (bench/maxtext_anchor.py runs this and prices what it writes).

Runs in .venv-maxtext (bench/maxtext/setup.sh: MaxText, its jax and libtpu, on Python >= 3.12), never in our
venv, and imports nothing of ours. It runs MaxText's own deviceless compile (train_compile.main) with the
given MaxText settings and keeps what that compile made, through the function train_compile hands the
compiled step to when asked to save it (save_compiled), so the program is exactly MaxText's:

    .venv-maxtext/bin/python bench/maxtext/compile_maxtext.py OUT model_name=llama3.1-8b compile_topology=v6e-256 ...

writes OUT.hlo.txt (the optimized HLO) and OUT.json (compile seconds, memory per device as the target's
compiler plans it). The TPU compiler's flags come from LIBTPU_INIT_ARGS, as on a TPU VM.

For GPUs, `--gpu NAME TOPOLOGY TARGET_CONFIG` after OUT (JAX's CUDA topology: a device name, hosts x
devices as "1x1x8", a GpuTargetConfig text proto file) and the settings `internal_compile=True
internal_compile_num_devices=N`: MaxText's own GPU compile takes the devices of the machine it runs on
(jax.devices()), and its internal_compile asks JAX for a TPU topology, which here becomes that CUDA one.
Its attention on a GPU (attention=flash) is tokamax's Pallas Triton kernel, which checks for a GPU at trace
time unless told it is cross-compiling (tokamax.config.cross_compile).
"""

import contextlib
import json
import os
import sys
import time

# As bench/compile_for.py: compile for the target, run nothing, look for no TPU host.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from maxtext.configs import __file__ as _configs_init  # noqa: E402
from maxtext.trainers.pre_train import train_compile  # noqa: E402

BASE_CONFIG = os.path.join(os.path.dirname(_configs_init), "base.yml")
MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                 "generated_code_size_in_bytes", "host_temp_size_in_bytes", "host_argument_size_in_bytes")


def use_gpu_topology(name: str, topology: str, target_config_file: str) -> None:
    """MaxText's internal_compile gets these CUDA devices where it asks for a TPU topology."""
    from jax.experimental import topologies

    with open(target_config_file) as f:
        devices = topologies.get_topology_desc(name, "cuda", target_config=f.read(), topology=topology)
    train_compile.get_topology_desc = lambda **_: devices


def main(argv: list[str]) -> None:
    usage = "usage: compile_maxtext.py OUT [--gpu NAME TOPOLOGY TARGET_CONFIG] [maxtext_key=value ...]"
    if len(argv) < 2 or "=" in argv[1]:
        sys.exit(usage)
    out, given = argv[1], argv[2:]
    settings, compiling = given, contextlib.nullcontext()
    if settings[:1] == ["--gpu"]:
        if len(settings) < 4:
            sys.exit(usage)
        use_gpu_topology(*settings[1:4])
        settings = settings[4:]
        import tokamax

        compiling = tokamax.config.cross_compile(True)
    flags = os.environ.get("LIBTPU_INIT_ARGS", "")  # as given: MaxText adds its own to the variable
    kept = []
    # train_compile calls save_compiled(compiled, path) after compiling when compiled_trainstep_file is set.
    train_compile.save_compiled = lambda compiled, _path: kept.append(compiled)
    start = time.perf_counter()
    with compiling:
        train_compile.main(["train_compile", BASE_CONFIG, *settings, f"compiled_trainstep_file={out}.unused"])
    seconds = time.perf_counter() - start
    if not kept:
        sys.exit("MaxText's train_compile finished without handing over its compiled step")
    compiled = kept[0]
    with open(out + ".hlo.txt", "w") as f:
        f.write(compiled.as_text())
    memory = compiled.memory_analysis()
    facts = {"compile_s": seconds, "settings": given, "libtpu_init_args": flags,
             "memory": {name: getattr(memory, name, None) for name in MEMORY_FIELDS}}
    with open(out + ".json", "w") as f:
        json.dump(facts, f, indent=1)
    print(f"wrote {out}.hlo.txt and {out}.json ({seconds:.0f} s)")


if __name__ == "__main__":
    main(sys.argv)
