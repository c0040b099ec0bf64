"""Training-step time of this checkout against another commit of the code, side by side.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.compare_commits \\
        --base 99c9226 --config local_test_synthetic [--rounds 8] [-- key=value ...]

Each version runs in a process of its own, started in its own tree (the base commit's is unpacked into
a temporary folder), so each imports its own train.py, package and configs. The two processes take
turns, one step each (base, new, base, new, ...), so that a noisy machine slows both alike; the
result is the median of the per-round ratios new/base, with each side's median step time and XLA's
temporary memory. Any commit whose train.py has make_mesh, Config, config_from_dict, init_state and
training_step(state, step, targets, is_seq_start, loss_mask, cfg) compares. Config keys that the base's
Config does not have are dropped for it and named. Batches are bench/measure_step.py's random tokens,
one document a row, the same on both sides.
"""

import argparse
import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile

import numpy as np

from bench.measure_step import random_tokens
from seqax import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One side, `python -c WORKER CONFIG_JSON BATCH_NPZ` in its tree (the working directory is first on
# sys.path, so `import train` is that tree's). It prints a line of JSON when it has imported train.py (the
# files of train.py and of the module of ours that train.make_mesh comes from),
# another when its step is compiled and warm, then answers each line "step" on stdin with the step's
# time in seconds.
WORKER = r"""
import dataclasses, json, sys, time
import jax, jax.numpy as jnp, numpy as np
import train
print(json.dumps({"train": train.__file__, "make_mesh": sys.modules[train.make_mesh.__module__].__file__}), flush=True)

def known(cls, values, prefix=""):
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    kept, dropped = {}, []
    for key, value in values.items():
        if key not in types:
            dropped.append(prefix + key)
        elif dataclasses.is_dataclass(types[key]):
            kept[key], more = known(types[key], value, f"{prefix}{key}.")
            dropped += more
        else:
            kept[key] = value
    return kept, dropped

values, dropped = known(train.Config, json.loads(sys.argv[1]))
cfg = train.config_from_dict(train.Config, values)
mesh = train.make_mesh(cfg.mesh.d, cfg.mesh.t)
batches = np.load(sys.argv[2])
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
batch = [jax.device_put(batches[name], sharding) for name in ("targets", "is_seq_start", "loss_mask")]
with jax.set_mesh(mesh):
    state = train.init_state(cfg, mesh)
    step_fn = train.training_step.lower(state, jnp.uint32(0), *batch, cfg).compile()
    state, metrics = step_fn(state, jnp.uint32(0), *batch)
    jax.block_until_ready(metrics)
    print(json.dumps({"dropped": dropped, "temp_bytes": step_fn.memory_analysis().temp_size_in_bytes}), flush=True)
    for line in sys.stdin:
        start = time.perf_counter()
        state, metrics = step_fn(state, jnp.uint32(0), *batch)
        jax.block_until_ready(metrics)
        print(time.perf_counter() - start, flush=True)
"""


def unpack(commit: str, folder: str):
    """The tree of `commit` (its train.py, package, configs) into `folder`."""
    source = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:train.py"], capture_output=True, text=True)
    if source.returncode:
        sys.exit(f"bench.compare_commits: error: cannot read train.py at {commit!r}: {source.stderr.strip()}")
    archive = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", commit], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")


class Side:
    """One version's worker process, started in `tree` with the config `values` and the batch file."""

    def __init__(self, name: str, tree: str, values: dict, batch_file: str):
        self.name = name
        self.process = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(values), batch_file], cwd=tree,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.files = self.answer()  # where its train.py and its make_mesh's module come from

    def answer(self):
        line = self.process.stdout.readline()
        if not line:
            sys.exit(f"bench.compare_commits: error: the {self.name} process stopped (its traceback is above)")
        return json.loads(line)

    def ready(self) -> dict:
        """Waits for the compiled, warm step: {"dropped": [config keys], "temp_bytes": int}."""
        return self.answer()

    def step(self) -> float:
        self.process.stdin.write("step\n")
        self.process.stdin.flush()
        return float(self.answer())

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def compare(args, cfg, base_tree: str, batch_file: str):
    values = dataclasses.asdict(cfg)
    base, new = Side("base", base_tree, values, batch_file), Side("new", ROOT, values, batch_file)
    try:
        base_ready, new_ready = base.ready(), new.ready()
        if base_ready["dropped"]:
            print(f"keys the base does not have, dropped for it: {', '.join(base_ready['dropped'])}")
        base_times, new_times = [], []
        for _ in range(args.rounds):
            base_times.append(base.step())
            new_times.append(new.step())
    finally:
        base.close(), new.close()
    ratio = float(np.median(np.array(new_times) / np.array(base_times)))
    print(f"config {args.config} {' '.join(args.overrides)}; mesh d={cfg.mesh.d} t={cfg.mesh.t}")
    print(f"step time median: base ({args.base}) {np.median(base_times) * 1e3:.0f} ms, "
          f"this checkout {np.median(new_times) * 1e3:.0f} ms")
    print(f"median ratio this/base over {args.rounds} alternating rounds: {ratio:.3f}")
    print(f"XLA temporary memory per device: base {base_ready['temp_bytes'] / 2**20:.1f} MiB, "
          f"this checkout {new_ready['temp_bytes'] / 2**20:.1f} MiB")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="commit (or branch, tag) whose code is the baseline")
    parser.add_argument("--config", default="local_test_synthetic")
    parser.add_argument("--rounds", type=int, default=8,
                        help="timed rounds, each one step of each version, after one warm-up round")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for both versions, e.g. training.tokens.len=2048")
    args = parser.parse_args(argv)
    cfg = config.load_config(args.config, args.overrides + ["+paths.model_name=compare"])
    with tempfile.TemporaryDirectory() as folder:
        base_tree, batch_file = os.path.join(folder, "base"), os.path.join(folder, "batch.npz")
        unpack(args.base, base_tree)
        np.savez(batch_file, **dict(zip(("targets", "is_seq_start", "loss_mask"), random_tokens(cfg))))
        compare(args, cfg, base_tree, batch_file)


if __name__ == "__main__":
    main()
