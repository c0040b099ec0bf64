"""MaxText's own training step compiled for a TPU slice that is not here: the anchor that our roofline prices
beside our step (bench/maxtext_anchor.py runs this and prices what it writes).

Runs in .venv-maxtext (bench/maxtext/setup.sh: MaxText, its jax and libtpu, on Python >= 3.12), never in our
venv, and imports nothing of ours. It runs MaxText's own deviceless compile (train_compile.main) with the
given MaxText settings and keeps what that compile made, through the function train_compile hands the
compiled step to when asked to save it (save_compiled), so the program is exactly MaxText's:

    .venv-maxtext/bin/python bench/maxtext/compile_maxtext.py OUT model_name=llama3.1-8b compile_topology=v6e-256 ...

writes OUT.hlo.txt (the optimized HLO) and OUT.json (compile seconds, memory per device as the TPU
compiler plans it). The TPU compiler's flags come from LIBTPU_INIT_ARGS, as on a TPU VM.
"""

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


def main(argv: list[str]) -> None:
    if len(argv) < 2 or "=" in argv[1]:
        sys.exit("usage: compile_maxtext.py OUT [maxtext_key=value ...]")
    out, settings = argv[1], argv[2:]
    flags = os.environ.get("LIBTPU_INIT_ARGS", "")  # as given: MaxText adds its own to the variable
    kept = []
    # train_compile calls save_compiled(compiled, path) after compiling when compiled_trainstep_file is set.
    train_compile.save_compiled = lambda compiled, _path: kept.append(compiled)
    start = time.perf_counter()
    train_compile.main(["train_compile", BASE_CONFIG, *settings, f"compiled_trainstep_file={out}.unused"])
    seconds = time.perf_counter() - start
    if not kept:
        sys.exit("MaxText's train_compile finished without handing over its compiled step")
    compiled = kept[0]
    with open(out + ".hlo.txt", "w") as f:
        f.write(compiled.as_text())
    memory = compiled.memory_analysis()
    facts = {"compile_s": seconds, "settings": settings, "libtpu_init_args": flags,
             "memory": {name: getattr(memory, name, None) for name in MEMORY_FIELDS}}
    with open(out + ".json", "w") as f:
        json.dump(facts, f, indent=1)
    print(f"wrote {out}.hlo.txt and {out}.json ({seconds:.0f} s)")


if __name__ == "__main__":
    main(sys.argv)
