"""Training-step time of this checkout's train.py against train.py at another commit, side by side.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.compare_commits \\
        --base 99c9226 --config local_test_synthetic [--rounds 8] [-- key=value ...]

Both versions are compiled in one process and their steps alternate (base, new, base, new, ...),
so that a noisy machine slows both alike; the result is the median of the per-round ratios
new/base, with each side's median step time and XLA's temporary memory. The base commit's
train.py is loaded as a module of its own next to this checkout's other files, so it must work
with them (a change confined to train.py compares cleanly). Config keys that the base's Config
does not have are dropped for it and named. Batches are bench/measure_step.py's: random tokens,
one document a row.
"""

import argparse
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import config
import train
from bench.measure_step import random_batch
from jax_extra import config_from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_train_at(commit: str):
    """train.py as it was at `commit`, imported as the module `train_at_<commit>`."""
    source = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:train.py"], capture_output=True, text=True)
    if source.returncode:
        sys.exit(f"bench.compare_commits: error: cannot read train.py at {commit!r}: {source.stderr.strip()}")
    name = "train_at_" + re.sub(r"\W", "_", commit)  # a branch like origin/main is a valid module name too
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"{name}.py")
        with open(path, "w") as f:
            f.write(source.stdout)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def keys_known_to(cls, values: dict, prefix: str = "") -> tuple[dict, list[str]]:
    """`values` without the keys that the config dataclass `cls` (and its nested ones) lacks,
    and the dotted names of those keys."""
    field_types = {f.name: f.type for f in dataclasses.fields(cls)}
    kept, dropped = {}, []
    for key, value in values.items():
        if key not in field_types:
            dropped.append(prefix + key)
        elif dataclasses.is_dataclass(field_types[key]):
            kept[key], more = keys_known_to(field_types[key], value, f"{prefix}{key}.")
            dropped += more
        else:
            kept[key] = value
    return kept, dropped


class Side:
    """One version's compiled step, state and batch."""

    def __init__(self, module, h):
        self.module, self.mesh = module, module.make_mesh(h.mesh.d, h.mesh.t)
        self.batch = random_batch(h, self.mesh)
        with jax.set_mesh(self.mesh):
            self.state = module.init_state(h, self.mesh)
            self.step_fn = module.training_step.lower(self.state, jnp.uint32(0), *self.batch, h).compile()
        self.temp_bytes = self.step_fn.memory_analysis().temp_size_in_bytes

    def step(self) -> float:
        with jax.set_mesh(self.mesh):
            start = time.perf_counter()
            self.state, metrics = self.step_fn(self.state, jnp.uint32(0), *self.batch)
            jax.block_until_ready(metrics)
            return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="commit (or branch, tag) whose train.py is the baseline")
    parser.add_argument("--config", default="local_test_synthetic")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds, each one step of each version, after one warm-up round")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for both versions, e.g. training.tokens.len=2048")
    args = parser.parse_args(argv)
    h = config.load_config(args.config, args.overrides + ["+paths.model_name=compare"])
    base_module = load_train_at(args.base)
    values, dropped = keys_known_to(base_module.Config, dataclasses.asdict(h))
    if dropped:
        print(f"keys the base does not have, dropped for it: {', '.join(dropped)}")
    base, new = Side(base_module, config_from_dict(base_module.Config, values)), Side(train, h)
    base.step(), new.step()
    base_times, new_times = [], []
    for _ in range(args.rounds):
        base_times.append(base.step())
        new_times.append(new.step())
    ratio = float(np.median(np.array(new_times) / np.array(base_times)))
    print(f"config {args.config} {' '.join(args.overrides)}; {jax.device_count()} x {jax.devices()[0].device_kind}, mesh d={h.mesh.d} t={h.mesh.t}")
    print(f"step time median: base ({args.base}) {np.median(base_times) * 1e3:.0f} ms, this checkout {np.median(new_times) * 1e3:.0f} ms")
    print(f"median ratio this/base over {args.rounds} alternating rounds: {ratio:.3f}")
    print(f"XLA temporary memory per device: base {base.temp_bytes / 2**20:.1f} MiB, this checkout {new.temp_bytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
