"""Training-step time of this checkout against another commit of the code, side by side.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.compare_commits \\
        --base 99c9226 --config local_test_synthetic [--rounds 8] [-- key=value ...]

Both versions are compiled in one process and their steps alternate (base, new, base, new, ...),
so that a noisy machine slows both alike; the result is the median of the per-round ratios
new/base, with each side's median step time and XLA's temporary memory. The base is the whole
commit: its train.py runs with the config.py, attention.py, shardlib, ... of that commit, so any
commit whose train.py has make_mesh, Config, init_state and training_step(state, step, targets,
is_seq_start, loss_mask, cfg) compares. Config keys that the base's Config does not have are
dropped for it and named. Batches are bench/measure_step.py's: random tokens, one document a row.
"""

import argparse
import dataclasses
import importlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import config
import train
from bench.measure_step import random_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def our_top_level_modules(tree: str) -> set[str]:
    """The names under which the Python files and packages at the top of `tree` are imported."""
    names = set()
    for entry in os.listdir(tree):
        if entry.endswith(".py"):
            names.add(entry[: -len(".py")])
        elif os.path.isfile(os.path.join(tree, entry, "__init__.py")):
            names.add(entry)
    return names


def load_train_at(commit: str, folder: str):
    """train.py as it was at `commit`, with the modules of ours it imports as they were then too:
    the commit's tree is unpacked into `folder` and imported there under our modules' names,
    which are then handed back to this checkout's modules. The base's train.py keeps its own
    config.py, attention.py, shardlib, ... (its functions hold them in their globals)."""
    source = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:train.py"], capture_output=True, text=True)
    if source.returncode:
        sys.exit(f"bench.compare_commits: error: cannot read train.py at {commit!r}: {source.stderr.strip()}")
    archive = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", commit], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    names = our_top_level_modules(folder)

    def ours(module: str) -> bool:
        return module.split(".")[0] in names

    checkout = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in checkout:
        del sys.modules[name]
    sys.path.insert(0, folder)
    try:
        return importlib.import_module("train")
    finally:
        sys.path.remove(folder)
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(checkout)


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

    def __init__(self, module, cfg):
        self.module, self.mesh = module, module.make_mesh(cfg.mesh.d, cfg.mesh.t)
        self.batch = random_batch(cfg, self.mesh)
        with jax.set_mesh(self.mesh):
            self.state = module.init_state(cfg, self.mesh)
            self.step_fn = module.training_step.lower(self.state, jnp.uint32(0), *self.batch, cfg).compile()
        self.temp_bytes = self.step_fn.memory_analysis().temp_size_in_bytes

    def step(self) -> float:
        with jax.set_mesh(self.mesh):
            start = time.perf_counter()
            self.state, metrics = self.step_fn(self.state, jnp.uint32(0), *self.batch)
            jax.block_until_ready(metrics)
            return time.perf_counter() - start


def compare(args, cfg, base_module):
    values, dropped = keys_known_to(base_module.Config, dataclasses.asdict(cfg))
    if dropped:
        print(f"keys the base does not have, dropped for it: {', '.join(dropped)}")
    base, new = Side(base_module, config.config_from_dict(base_module.Config, values)), Side(train, cfg)
    base.step(), new.step()
    base_times, new_times = [], []
    for _ in range(args.rounds):
        base_times.append(base.step())
        new_times.append(new.step())
    ratio = float(np.median(np.array(new_times) / np.array(base_times)))
    print(f"config {args.config} {' '.join(args.overrides)}; {jax.device_count()} x {jax.devices()[0].device_kind}, "
          f"mesh d={cfg.mesh.d} t={cfg.mesh.t}")
    print(f"step time median: base ({args.base}) {np.median(base_times) * 1e3:.0f} ms, "
          f"this checkout {np.median(new_times) * 1e3:.0f} ms")
    print(f"median ratio this/base over {args.rounds} alternating rounds: {ratio:.3f}")
    print(f"XLA temporary memory per device: base {base.temp_bytes / 2**20:.1f} MiB, "
          f"this checkout {new.temp_bytes / 2**20:.1f} MiB")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="commit (or branch, tag) whose code is the baseline")
    parser.add_argument("--config", default="local_test_synthetic")
    parser.add_argument("--rounds", type=int, default=8,
                        help="timed rounds, each one step of each version, after one warm-up round")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for both versions, e.g. training.tokens.len=2048")
    args = parser.parse_args(argv)
    cfg = config.load_config(args.config, args.overrides + ["+paths.model_name=compare"])
    with tempfile.TemporaryDirectory() as folder:  # the base's source files, for its tracebacks
        compare(args, cfg, load_train_at(args.base, folder))


if __name__ == "__main__":
    main()
