"""Which ways of writing a float8 matmul's operand cast the GPU compiler folds into the GEMM itself (the GEMM
reads the bf16 tensor and converts it as it loads it) and which leave a cast kernel that writes an e4m3 copy
first: one pass over the operand more (docs/performance.md, "What XLA fuses into a float8 GEMM").

    .venv-compilers/bin/python -m bench.float8_fusion [--target h200] [--shape 77824 2048 5632]

Each form compiles x [N, K] (bf16) times w [K, F] (bf16, cast to e4m3 as it is) for one device of the target,
deviceless; the line says whether the optimized HLO has a kernel of its own that writes the e4m3 copy of x.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bench.compile_for import target_devices
from seqax.analysis.targets import TARGETS
from seqax.shardlib.float8 import E4M3, scaled

# The operand's cast, written each way: x bf16 [N, K], s a float32 scalar (a power of two, as float8.py's).
FORMS = {
    "bare convert": lambda x, s: x.astype(E4M3),
    "times a constant 2.0": lambda x, s: (x * 2.0).astype(E4M3),
    "clipped to +-448": lambda x, s: jnp.clip(x, -448, 448).astype(E4M3),
    "times the scale (bf16)": lambda x, s: (x * s.astype(x.dtype)).astype(E4M3),
    "times the scale (float32)": lambda x, s: (x.astype(jnp.float32) * s).astype(E4M3),
    "over the scale": lambda x, s: (x / s.astype(x.dtype)).astype(E4M3),
    "scale added to the exponent bits": lambda x, s: lax.bitcast_convert_type(
        lax.bitcast_convert_type(x, jnp.int16) + s.astype(jnp.int16), jnp.bfloat16).astype(E4M3),
    "float8.scaled (amax, scale, clip: train.py's)": lambda x, s: scaled(x, E4M3)[0],
}


def has_cast_kernel(hlo_text: str, rows: int, cols: int) -> bool:
    """Whether the entry computation runs a fusion whose result is x's e4m3 copy [rows, cols]."""
    shape = f"f8e4m3fn[{rows},{cols}]"
    return any(f"= {shape}" in line and " fusion(" in line for line in hlo_text.splitlines())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="h200", choices=[n for n, t in TARGETS.items() if t.platform == "cuda"])
    parser.add_argument("--shape", type=int, nargs=3, default=[77824, 2048, 5632], metavar=("N", "K", "F"),
                        help="x [N, K] times w [K, F] (default: gpu1_1b's gate projection)")
    args = parser.parse_args(argv)
    n, k, f = args.shape
    mesh = Mesh(np.array(target_devices(TARGETS[args.target], 1)), ("d",))
    whole = NamedSharding(mesh, PartitionSpec())
    operands = [jax.ShapeDtypeStruct((n, k), jnp.bfloat16, sharding=whole),
                jax.ShapeDtypeStruct((k, f), jnp.bfloat16, sharding=whole),
                jax.ShapeDtypeStruct((), jnp.float32, sharding=whole)]
    print(f"x [{n}, {k}] bf16 as e4m3, times w [{k}, {f}] as e4m3, on one {args.target}:")
    for name, cast in FORMS.items():
        def product(x, w, s, cast=cast):
            return jnp.dot(cast(x, s), w.astype(E4M3), preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        hlo_text = jax.jit(product).lower(*operands).compile().as_text()
        verdict = "a cast kernel writes x's e4m3 copy first" if has_cast_kernel(hlo_text, n, k) else \
            "folded into the GEMM (it reads x as bf16)"
        print(f"  {name:48s} {verdict}", flush=True)


if __name__ == "__main__":
    main()
