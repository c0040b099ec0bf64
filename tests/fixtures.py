"""What several test files share: a tiny config and meshes, random batches, weights and states,
datasets written in this process, and `python -m train` as a child process."""

import contextlib
import dataclasses
import errno
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from omegaconf import OmegaConf

import train
from bench.mesh_agreement import metrics_on_meshes  # noqa: F401 (the tests' name for it)
from seqax import config
from seqax.checkpoint import Checkpointer
from seqax.config import load_config
from seqax.data.data_loader import zigzag_order
from seqax.data.flat_tokens import open_flat_tokens, write_flat_tokens
from seqax.data.tokenizer import ByteTokenizer, dataset_tokenizer
from seqax.shardlib.shardtypes import abstract_arrays, bool_, f32, typed_shard_map, u32
from tools import prepare_dataset
from tools.launch_local import free_port
from tools.write_synthetic_dataset import main as write_synthetic_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every weight dimension that a mesh axis splits divides 8, so every mesh of 8 devices fits.
TINY = [
    "model.d_model=64", "model.n_q_per_kv=2", "model.n_kv=8", "model.d_head=8", "model.d_ff=128", "model.layers=2",
    "model.vocab=256", "model.attention_block=8",
    "training.tokens.batch=8", "training.tokens.len=16", "training.steps=20", "training.warmup_steps=4",
    "training.learning_rate=1e-2", "training.weight_decay=0.1", "training.muon_learning_rate=0.02",
    # No profile: stopping the trace takes a tiny run about 1.7 s, a quarter of it (docs/performance.md, "Test
    # times"); tests/test_records.py checks the profile, with profile_steps set back.
    "profile_steps=0",
]

# ---------------------------------------------------------------------------------------------
# Configs, meshes, batches, weights and states.


def tiny_overrides(*changes: str) -> list[str]:
    """TINY with each key that `changes` sets replaced by the change."""
    keys = tuple(c.split("=")[0] + "=" for c in changes)
    return [a for a in TINY if not a.startswith(keys)] + list(changes)


def tiny_config(*overrides: str) -> config.Config:
    """local_test_synthetic with TINY and `overrides`, as a run named "test"."""
    return load_config("local_test_synthetic", ["+paths.model_name=test", *tiny_overrides(*overrides)])


def float32_config(cfg: config.Config) -> config.Config:
    """`cfg` with float32 matmuls (model.matmul_dtype): comparisons where only the order of sums may differ."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, matmul_dtype="float32"))


def make_mesh(d: int, t: int, c: int = 1) -> jax.sharding.Mesh:
    return train.make_mesh(d, t, c, devices=jax.devices()[: d * t * c])


def reference_config(h: config.ModelConfig) -> dict:
    """The model settings tests/reference.py reads."""
    return {k: getattr(h, k) for k in ("n_kv", "n_q_per_kv", "d_head", "rope_base", "norm_eps", "experts_per_token")}


def random_batch(seed: int, batch: int, length: int, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Targets, document starts and loss mask with several documents per row; some rows start
    mid-document, and some end in padding (target 0, a start of its own, masked out) as the
    loader pads."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(1, vocab, size=(batch, length)).astype(np.uint32)
    starts = rng.random((batch, length)) < 0.2
    starts[::2, 0] = True
    mask = np.ones((batch, length), bool)
    mask[1::3, -3:] = False
    targets[~mask], starts[~mask] = 0, True
    return targets, starts, mask


def put_batch(mesh, batch):
    """Host arrays [B, L] on `mesh` as the loader places them: rows split over d, and each row's
    positions over c in the zigzag order (data_loader.zigzag_order)."""
    order = zigzag_order(batch[0].shape[1], mesh.shape["c"])
    return jax.device_put(tuple(x[:, order] for x in batch),
                          jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", "c")))


def forward_logits(h: config.ModelConfig):
    """train.forward jitted on the mesh set with jax.set_mesh: (weights, inputs [B, L],
    is_seq_start [B, L]) -> next-token logits [B, L, V]."""

    @jax.jit
    @typed_shard_map
    def logits(w: train.Model, inputs: u32[b"B/d L/c"], is_seq_start: bool_[b"B/d L/c"]) -> f32[b"B/d L/c V/t"]:
        return train.forward(h, w, inputs, is_seq_start)[0]

    return logits


def perturbed_weights(cfg: config.Config) -> train.Model:
    """Initial weights with every weight that starts constant (the norms' gains at 1, a bias at 0), whatever
    it is called, moved off that value, so that its gradient means something."""
    w = train.init_weights(cfg.model, jax.random.key(0))
    key = jax.random.key(1)

    def bump(path, x):
        if x.size == 0 or bool(jax.numpy.any(x != x.reshape(-1)[0])):
            return x
        return x + 0.2 * jax.random.normal(jax.random.fold_in(key, sum(map(ord, jax.tree_util.keystr(path)))), x.shape)

    return jax.tree_util.tree_map_with_path(bump, w)


def abstract_state(cfg: config.Config, mesh) -> train.State:
    """The state's shapes, dtypes and shardings on `mesh`, without any array."""
    return abstract_arrays(jax.eval_shape(lambda: train.init_state(cfg, mesh)), train.State, mesh)


def random_state(cfg: config.Config, mesh) -> train.State:
    """A state with every leaf drawn at random (Adam's second moment positive), on `mesh`."""
    rng = np.random.default_rng(0)
    state = abstract_state(cfg, mesh)

    def draw(part: str):
        positive = np.abs if part == "adam_nu" else np.asarray
        return jax.tree.map(lambda s: jax.device_put(positive(0.05 * rng.standard_normal(s.shape)).astype(np.float32),
                                                     s.sharding), getattr(state, part))

    return train.State(**{part: draw(part) for part in vars(state)})


# ---------------------------------------------------------------------------------------------
# Datasets, written in this process (the tools' own main functions).


def decoded(path: str) -> dict[str, list[str]]:
    """The documents of a flat-tokens dataset by split, decoded with its own tokenizer."""
    dataset, tokenizer = open_flat_tokens(path), dataset_tokenizer(path)
    out = {}
    for name, split in dataset.splits.items():
        starts, tokens = split.seq_starts[:].astype(int), split.encoded_tokens[:] >> 1
        out[name] = [tokenizer.decode(tokens[a:b]) for a, b in zip(starts[:-1], starts[1:])]
    return out


def synthetic_dataset(path, *args: str) -> str:
    """tools/write_synthetic_dataset.py's dataset at `path` (its defaults: what `make train` uses)."""
    write_synthetic_dataset(["--output", str(path), *args])
    return str(path)


def prepared_dataset(path, *args: str) -> str:
    """tools/prepare_dataset.py's dataset of the inputs and flags `args`, at `path`."""
    prepare_dataset.main([*args, "--output", str(path), "--workers", "1", "--quiet"])
    return str(path)


def checkpointed_bytes_run(root) -> str:
    """root/run: a tiny bytes-tokenized model's config.yaml and checkpoint 1 (its initial weights), for the
    tools that read a run; root/data.zarr its dataset. Returns the run directory."""
    data = str(root / "data.zarr")
    docs = [np.frombuffer(b"hello world", np.uint8).astype(np.uint32) + 1] * 8
    write_flat_tokens(data, {"train": docs, "validation": docs[:1]}, {"tokenizer": ByteTokenizer().identity()})
    cfg = load_config("local_test_synthetic", ["model.d_model=64", "model.n_kv=2", "model.d_head=16", "model.d_ff=128",
                                               "model.layers=1", "model.vocab=258", "+paths.model_name=run",
                                               f"paths.root_working_dir={root}", f"dataset.path={data}"])
    os.makedirs(root / "run")
    (root / "run" / "config.yaml").write_text(OmegaConf.to_yaml(dataclasses.asdict(cfg)))
    checkpointer = Checkpointer(str(root / "run" / "checkpoints"), cfg.checkpoints)
    checkpointer.save(1, train.init_state(cfg, train.make_mesh(4, 2)))
    checkpointer.close()
    return str(root / "run")


# ---------------------------------------------------------------------------------------------
# `python -m train` in a child process.


def run_overrides(root, dataset: str, name: str, *overrides: str) -> list[str]:
    """The overrides of local_test_synthetic for a run `name` under `root` on `dataset`."""
    return [f"+paths.model_name={name}", f"paths.root_working_dir={root}", f"dataset.path={dataset}", *overrides]


def train_args(root, dataset: str, name: str, *overrides: str) -> list[str]:
    """The command line (after `python -m train`) of that run."""
    return ["--config-name=local_test_synthetic", *run_overrides(root, dataset, name, *overrides)]


def child_env(devices: int | None = 8, cache=None, graph: bool = True) -> dict:
    """This process's environment for a child: `devices` simulated CPU devices (None: no
    XLA_FLAGS, for a launcher that sets its own) and, with `cache`, a persistent compilation
    cache in that folder that keeps every entry (children that compile the same step share it).

    graph=False leaves graphviz's `dot` off the PATH (every folder that holds one is dropped), for
    a test that reads neither training_step.svg nor the warning line this gives on stderr: a run
    then writes training_step.dot but does not draw it. Drawing it takes `dot` a few seconds of CPU
    (hlo_graph caps its layout effort: 4 s for local_test_synthetic's step), which the run shares
    and waits for at its end (startup_report.StartupReport, up to 30 s)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if cache is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    if not graph:
        env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                      if d and not os.path.exists(os.path.join(d, "dot")))
    return env


def train_command(args: list[str], float32: bool) -> list[str]:
    """The command line of `python -m train ARGS`, its matmuls in float32 if `float32`: runs on two meshes
    compared where only the order of float32 sums may differ. In bf16 any step after the first drifts
    between meshes by up to a few 1e-4, by how much depending on the CPU that rounds (test_optimizer's
    test_training_steps_agree_on_every_mesh)."""
    return [sys.executable, "-m", "train", *args, *(["model.matmul_dtype=float32"] if float32 else [])]


def run_train(args: list[str], devices: int = 8, cache=None, timeout: int = 600, graph: bool = True,
              float32: bool = False) -> subprocess.CompletedProcess:
    """`python -m train ARGS` to its end, its output captured as text (`graph`: see child_env; `float32`:
    train_command)."""
    return subprocess.run(train_command(args, float32), cwd=ROOT, env=child_env(devices, cache, graph),
                          capture_output=True, text=True, timeout=timeout)


def start_train(args: list[str], devices: int = 8, cache=None, graph: bool = True, float32: bool = False,
                **popen) -> subprocess.Popen:
    """`python -m train ARGS` started in the background (Popen keywords in `popen`; `graph`: see child_env;
    `float32`: train_command)."""
    return subprocess.Popen(train_command(args, float32), cwd=ROOT, env=child_env(devices, cache, graph), **popen)


def run_processes(script: str, n: int, *args: str, timeout: int = 120) -> list[str]:
    """tests/SCRIPT as the n processes of one jax.distributed run on 127.0.0.1 (each gets the
    arguments PORT N PROCESS_ID ARGS...); asserts that every one exits 0; their outputs."""
    port, path = free_port(), os.path.join(ROOT, "tests", script)
    processes = [subprocess.Popen([sys.executable, path, str(port), str(n), str(i), *args], env=child_env(None),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(n)]
    outputs = [p.communicate(timeout=timeout)[0] for p in processes]
    assert all(p.returncode == 0 for p in processes), outputs
    return outputs


def snapshot(path) -> dict:
    """Every file under `path` with its bytes: the disk as a test can compare it before and after."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), path)] = fh.read()
    return out


# ---------------------------------------------------------------------------------------------
# Small and read-only disks, as the kernel makes them.


@contextlib.contextmanager
def mounted(path, options: str):
    """A fresh tmpfs mounted at `path` (created if need be) with mount options `options` (`size=3m`: a
    disk that fills after 3 MiB; `ro`: read-only) for the block, then unmounted. Needs the right to
    mount (root, or CAP_SYS_ADMIN in a container); where it is missing, the test is skipped, saying so.
    (A read-only directory is no test as root, whom file permissions do not stop.)"""
    os.makedirs(path, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                            text=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs at {path} (this test needs root or CAP_SYS_ADMIN): "
                    f"{(result.stderr or result.stdout).strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)  # lazy: a child's open file does not block it


def fill(disk) -> str:
    """Writes a file over every free byte of the file system at `disk`; returns its path."""
    path = os.path.join(disk, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return path
