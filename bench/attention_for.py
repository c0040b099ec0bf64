"""Attention alone, forward + backward, compiled for GPUs and TPUs that are not here by their own
compilers (bench/compile_for.py's devices), and timed by the roofline: bench/attention.py's methods
at the ladder's heads.

    .venv-compilers/bin/python -m bench.attention_for --target h200 [v6e ...] [--models 125m 350m 1b 2b]
        [--lengths 2048 8192 32768] [--batch 1] [--methods blockwise pallas pallas_triton pallas_hopper dense]
        [--json rows.json]

For the heads of each ladder model (configs/gpu1_MODEL.yaml: Q query heads per kv head, K kv
heads, d_head D) and each length, one row per method: by default blockwise with the ladder's
blocks (model.attention_block) and the Pallas kernels (cuDNN's kernel does not compile here: JAX
first asks the cuDNN library for its version, which a machine without a GPU lacks). Each row has
the roofline's time of the compiled forward + backward (roofline.py: a Pallas kernel at the matmul
FLOPs it states), the FLOPs bound (causal attention's forward and backward, 6 B Q K L^2 D FLOPs,
at the device's peak) and the roofline's distance from it, the compiler's temporary memory, and
the compile time.
"""

# bench.compile_for first: it points JAX at the compilers, which must happen before jax is imported
from bench.compile_for import target_devices  # noqa: I001

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import train  # noqa: E402
from bench.attention import method, value_and_grad  # noqa: E402
from seqax.analysis import roofline  # noqa: E402
from seqax.config import load_config  # noqa: E402
from seqax.analysis.targets import TARGETS  # noqa: E402


def compiled_for(target, name: str, block: int, B: int, L: int, Q: int, K: int, D: int):
    """(roofline seconds, temporary bytes, compile seconds) of the forward + backward of method `name`
    compiled for one `target` device."""
    mesh = train.make_mesh(1, 1, devices=target_devices(target, 1))
    replicated = NamedSharding(mesh, P())
    shapes = [((B, L, Q, K, D), jnp.bfloat16), ((B, L, K, D), jnp.bfloat16), ((B, L, K, D), jnp.bfloat16),
              ((B, L), jnp.uint32)]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in shapes]
    started = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = value_and_grad(method(name, block, mesh)).lower(*args).compile()
    seconds = time.perf_counter() - started
    step = roofline.roofline(compiled.as_text(), target.rates()).step_seconds
    return step, compiled.memory_analysis().temp_size_in_bytes, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", nargs="+", required=True, choices=sorted(TARGETS))
    parser.add_argument("--models", nargs="+", default=["125m", "350m", "1b", "2b"],
                        help="the ladder models whose heads to compile (configs/gpu1_MODEL.yaml)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--methods", nargs="+", default=["blockwise", "pallas"],
                        choices=["dense", "blockwise", "pallas", "pallas_triton", "pallas_hopper"])
    parser.add_argument("--json", help="also write the rows there, as a JSON list")
    args = parser.parse_args(argv)
    rows = []
    print(f"batch {args.batch}; per method: the roofline's forward + backward, the FLOPs bound (6 B Q K L^2 D at "
          "the peak) and their ratio, the compiler's temporary memory")
    print(f"{'target':>7} {'model':>6} {'Q x K':>6} {'L':>6} {'method':>14} {'roofline ms':>12} {'bound ms':>9} "
          f"{'ratio':>6} {'temp MiB':>9} {'compile s':>9}")
    for name in args.target:
        target = TARGETS[name]
        for model in args.models:
            h = load_config(f"gpu1_{model}", ["+paths.model_name=bench"]).model
            Q, K, D = h.n_q_per_kv, h.n_kv, h.d_head
            for L in args.lengths:
                bound = 6 * args.batch * Q * K * L * L * D / target.peak_flops
                for method_name in args.methods:
                    step, temp, seconds = compiled_for(target, method_name, h.attention_block, args.batch, L, Q, K, D)
                    label = f"blockwise {h.attention_block}" if method_name == "blockwise" else method_name
                    print(f"{name:>7} {model:>6} {f'{Q} x {K}':>6} {L:>6} {label:>14} {step * 1e3:>12.2f} "
                          f"{bound * 1e3:>9.2f} {step / bound:>6.2f} {temp / 2**20:>9.1f} {seconds:>9.1f}", flush=True)
                    rows.append({"target": name, "model": model, "length": L, "method": method_name,
                                 "roofline_seconds": step, "bound_seconds": bound, "temp_bytes": temp})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
