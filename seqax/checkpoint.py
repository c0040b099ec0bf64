"""Checkpoints of any pytree of sharded jax.Arrays as zarr v3 groups (docs/checkpoint-format.md).

    checkpointer = Checkpointer(run_dir + "/checkpoints", cfg)
    restored = checkpointer.restore(shapes, shardings)   # (step, tree) or None
    checkpointer.save(step, tree)   # returns after the device-to-host copy; writes in background
    checkpointer.close()            # waits for the write in flight

One array per leaf, named by its key path; one chunk per shard of the saving mesh, each ending in
a CRC32C checksum. Every process writes the shards it owns (replica 0) from a pool of threads;
process 0 commits by setting `write_completed` once every process has finished, and only
committed checkpoints are read. A restore reads, for each device, exactly the region that
device holds on the new mesh, so any mesh and any number of processes can read a checkpoint.
"""

import contextlib
import dataclasses
import errno
import itertools
import json
import os
import re
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import zarr
from jax.experimental import multihost_utils

from seqax import run_lock, sharded_zarr
from seqax.config import CheckpointConfig, CheckpointError, ConfigError, DivergedError
from seqax.console import warn

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^\d{10}$")
MARKER_TIMEOUT_S = 1800.0  # how long process 0 waits for the other processes' writes


# Rotation keeps at least the newest checkpoint and the one before it. The loss of a checkpoint's state
# is known only once the step after it has run: if that loss is not finite, the one before is the
# newest whose loss was, and the run resumes from it (Checkpointer.diverged).
KEEP_AT_LEAST = 2


@jax.jit
def _all_finite(leaves: list) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves] or [jnp.bool_(True)]))


class CorruptCheckpoint(Exception):
    """A committed checkpoint whose data fails its checksums or lacks chunks, or whose metadata
    contradicts itself."""


class CheckpointRemoved(CheckpointError):
    """A checkpoint deleted while it was read: rotation in the live run that writes the directory."""


class StateMismatch(CheckpointError):
    """A checkpoint whose arrays are not the state's: written for another model config, unless
    other checkpoints of the run fit the state (then this one is damaged). `what` is the mismatch alone."""

    def __init__(self, message: str, what: str):
        super().__init__(message)
        self.what = what


def leaf_names(tree) -> list[str]:
    """Array names of the leaves, in flattening order: key paths joined with '.'."""
    names = [jax.tree_util.keystr(path, simple=True, separator=".")
             for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    for name in names:
        if not name or "/" in name or name.startswith("__") or set(name) == {"."}:
            raise CheckpointError(f"pytree leaf with key path {name!r} cannot name a zarr array; "
                                  "use attribute, dict or sequence keys without '/'")
    return names


def placements_of(shapes, shardings) -> list:
    """The sharding of each leaf of `shapes`, in flattening order. `shardings` has the structure
    of `shapes` but may hold a sharding where `shapes` has None (a leaf the state does not have,
    such as an optimizer's moment of a weight the other optimizer updates)."""
    return jax.tree.leaves(jax.tree.map(lambda sharding, x: None if x is None else sharding, shardings, shapes))


def stored_dtype(dtype) -> np.dtype:
    """zarr lacks bfloat16 and the float8 types: they are stored as unsigned ints of equal size."""
    dtype = np.dtype(dtype)
    return np.dtype(f"<u{dtype.itemsize}") if dtype.kind == "V" else dtype


def _processes_agree(ok: bool) -> bool:
    """True when `ok` holds on every process."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array([ok]))))


def _barrier(name: str):
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _touch(path: str):
    with open(path, "w"):
        pass


def _replace_file_in(folder: str, name: str, data: bytes):
    """folder/name written whole or not at all (a temporary file renamed over it, as zarr's store writes
    metadata), without making `folder`: where it was deleted meanwhile (a run directory removed under a
    live run), the write fails; zarr's store would make it again, and every folder above it."""
    temporary = os.path.join(folder, f"{name}.{uuid.uuid4().hex}.partial")
    try:
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, os.path.join(folder, name))
    except BaseException:  # a full disk: no temporary file left beside the save's markers
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def _naming(path: str, job):
    """Runs `job()`; an OSError without a file name (a full disk's failed write has none) names `path`,
    so that the line the user sees says where the write failed."""
    try:
        return job()
    except OSError as e:
        if e.filename or e.errno is None:  # (one of ours, such as FileExistsError's message, says what it is)
            raise
        raise OSError(e.errno, e.strerror, path) from e


@dataclasses.dataclass
class _HostLeaf:
    name: str
    shape: tuple
    dtype: np.dtype  # the leaf's dtype; the stored one is stored_dtype(dtype)
    sharding: jax.sharding.Sharding
    data: dict  # chunk coordinates -> np.ndarray of the stored dtype: the chunks this process writes


class Checkpointer:
    def __init__(self, directory: str, cfg: CheckpointConfig, finite_only: bool = False):
        """`finite_only`: a tree holding a NaN or an inf is not saved (a training run's state: it diverged)."""
        if cfg.compression not in ("none", "zstd", "blosc"):
            raise ConfigError(f"checkpoints.compression={cfg.compression!r} is not one of none, zstd, blosc")
        if cfg.keep < 0 or cfg.threads < 1:
            raise ConfigError(f"checkpoints.keep={cfg.keep} must be >= 0 (0 keeps all) "
                              f"and checkpoints.threads={cfg.threads} >= 1")
        self.directory, self.cfg, self.finite_only = directory, cfg, finite_only
        self._parent = run_lock.path_identity(os.path.dirname(directory))  # the run directory, if it exists yet
        self._lock = run_lock.lock_identity(os.path.dirname(directory))  # a training run's lock, if it holds one
        self.process = jax.process_index()
        token = np.frombuffer(uuid.uuid4().bytes, np.uint8)
        if jax.process_count() > 1:  # every process names this run's markers alike
            token = multihost_utils.broadcast_one_to_all(token)
        self.token = bytes(np.asarray(token, np.uint8)).hex()
        self._io = ThreadPoolExecutor(cfg.threads, thread_name_prefix="checkpoint-io")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-save")
        self._in_flight: Future | None = None
        self._metadata: dict[tuple, bytes] = {}  # an array's zarr.json, by (name, shape, dtype, chunks)

    # ---- what is on disk ----

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, f"{step:010d}")

    def _attributes(self, step: int) -> dict | None:
        try:
            with open(os.path.join(self.step_dir(step), "zarr.json")) as f:
                return json.load(f)["attributes"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _unreadable_steps(self) -> list[int]:
        """Steps whose group zarr.json is missing or garbled although the directory holds arrays (their
        folders): damaged. (An interrupted save's group metadata is whole, or the directory holds no
        folder: it is written first, as a temporary file `zarr.json.*.partial` renamed to zarr.json, so
        a save killed before that rename leaves the temporary file alone; the markers of a save that
        failed writing it (a full disk cuts it short) are files too; and the commit rewrites it
        atomically.)"""
        return [s for s in self._steps_on_disk() if self._attributes(s) is None
                and any(entry.is_dir() for entry in os.scandir(self.step_dir(s)))]

    def _steps_on_disk(self) -> list[int]:
        names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
        return sorted(int(n) for n in names if STEP_DIR.match(n))

    def complete_steps(self) -> list[int]:
        """Steps of the committed checkpoints, oldest first."""
        return [s for s in self._steps_on_disk() if (self._attributes(s) or {}).get("write_completed") is True]

    def latest_step(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def _delete(self, steps: list[int]):
        """Renames (atomically) then removes, so a half-deleted checkpoint is never read."""
        for step in steps:
            trash = os.path.join(self.directory, f".deleted.{step:010d}.{uuid.uuid4().hex}")
            os.rename(self.step_dir(step), trash)
        for name in os.listdir(self.directory):
            if name.startswith(".deleted."):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    # ---- saving ----

    def save(self, step: int, tree):
        """Copies this process's shards to host memory, then writes them in the background.
        Waits first for the previous save (raising its error, if any). With `finite_only`, a tree
        with a NaN or an inf is not saved: a DivergedError."""
        self.wait()
        if self.finite_only and not bool(_all_finite(jax.tree.leaves(tree))):
            raise DivergedError(f"the state after step {step - 1} holds NaN or inf: training diverged, and stops "
                                "without saving it", step)
        self._in_flight = self._saver.submit(self._write, step, self._copy_to_host(tree))

    def _copy_to_host(self, tree) -> list[_HostLeaf]:
        leaves = jax.tree.leaves(tree)
        # An empty array (the experts of a dense model) has no chunk: its zarr.json holds its shape.
        owned = [[s for s in x.addressable_shards if s.replica_id == 0 and x.size] for x in leaves]
        for shards in owned:
            for s in shards:
                s.data.copy_to_host_async()

        def host_copy(shard, dtype):  # a copy we own: the state's buffers are donated next step
            return np.array(shard.data, copy=True).view(stored_dtype(dtype))

        def coords(shard, x):
            return tuple(a // n for (a, _), n in zip(sharded_zarr.region(shard.index, x.shape),
                                                     x.sharding.shard_shape(x.shape)))

        copies = [[self._io.submit(host_copy, s, x.dtype) for s in shards] for x, shards in zip(leaves, owned)]
        return [
            _HostLeaf(name, x.shape, np.dtype(x.dtype), x.sharding,
                      {coords(s, x): c.result() for s, c in zip(shards, cs)})
            for name, x, shards, cs in zip(leaf_names(tree), leaves, owned, copies)
        ]

    def _compressors(self) -> list:
        crc = zarr.codecs.Crc32cCodec()
        if self.cfg.compression == "zstd":
            return [zarr.codecs.ZstdCodec(level=self.cfg.level), crc]
        if self.cfg.compression == "blosc":
            return [zarr.codecs.BloscCodec(cname="lz4", clevel=self.cfg.level, shuffle="shuffle"), crc]
        return [crc]

    def _create(self, path: str, step: int, leaves: list[_HostLeaf], layouts: list[sharded_zarr.Layout]):
        """Process 0: the group (not yet committed) and every array's metadata. zarr writes an
        array's zarr.json once; later checkpoints of the same array reuse those bytes, which
        saves the most CPU time of a small checkpoint."""
        if os.path.exists(path):
            raise FileExistsError(f"checkpoint {path} already exists; restore() removes uncommitted ones before saving")
        parent = run_lock.path_identity(os.path.dirname(self.directory))
        if self._parent is not None and parent != self._parent:  # a run directory deleted stays deleted
            raise FileNotFoundError(errno.ENOENT, "deleted or replaced since the run started, not recreated",
                                    os.path.dirname(self.directory))
        if self._parent is None:  # no run directory when the run started: the folders are made
            os.makedirs(self.directory, exist_ok=True)
        elif not os.path.isdir(self.directory):  # made by mkdir, which fails where the run directory is gone
            os.mkdir(self.directory)
        attributes = {"format_version": FORMAT_VERSION, "step": step, "arrays": [leaf.name for leaf in leaves],
                      "write_completed": False, "array_shapes": {leaf.name: list(leaf.shape) for leaf in leaves},
                      "array_dtypes": {leaf.name: leaf.dtype.name for leaf in leaves}}
        os.mkdir(path)  # folders below are made with mkdir too: none is made again if the run's is deleted
        in_memory = {}  # zarr writes the group's metadata in memory, this module on disk (_replace_file_in)
        zarr.create_group(store=zarr.storage.MemoryStore(in_memory), attributes=attributes)
        _replace_file_in(path, "zarr.json", in_memory["zarr.json"].to_bytes())
        for leaf, layout in zip(leaves, layouts):
            key = (leaf.name, leaf.shape, leaf.dtype.name, layout)
            if key not in self._metadata:  # zarr writes it in memory (it would make missing folders on disk)
                in_memory = {}
                sharded_zarr.create(zarr.create_group(store=zarr.storage.MemoryStore(in_memory)), leaf.name,
                                    leaf.shape, stored_dtype(leaf.dtype), layout, self._compressors(),
                                    {"dtype": leaf.dtype.name})
                self._metadata[key] = in_memory[f"{leaf.name}/zarr.json"].to_bytes()
            os.mkdir(os.path.join(path, leaf.name))
            with open(os.path.join(path, leaf.name, "zarr.json"), "wb") as f:
                f.write(self._metadata[key])

    def _write(self, step: int, leaves: list[_HostLeaf]):
        """Every process: its chunks, then its `.written` marker. Process 0 first creates the
        metadata (then `.ready`) and last commits; the others return once it has committed.
        A process that fails leaves `.failed`, so that the others stop waiting."""
        path, markers = self.step_dir(step), os.path.join(self.step_dir(step), f".{{}}.{self.token}")
        written = [markers.format(f"written.{p}") for p in range(jax.process_count())]
        try:
            layouts = [sharded_zarr.plan(leaf.sharding, leaf.shape) for leaf in leaves]
            if self.process == 0:
                _naming(path, partial(self._create, path, step, leaves, layouts))
                _touch(markers.format("ready"))
            else:
                self._wait(lambda: os.path.exists(markers.format("ready")), step,
                           f"process 0 to create checkpoint {path}")
            files = []
            for leaf, layout in zip(leaves, layouts):
                array_dir = os.path.join(path, leaf.name)
                # zarr's write_empty_chunks is not stored with the array: without it, zarr writes no file
                # for a chunk or shard of zeros.
                array = (zarr.open_array(array_dir, mode="r+").with_config({"write_empty_chunks": True})
                         if self.cfg.compression != "none" else None)
                files += [[partial(_naming, array_dir, job) for job in file]
                          for file in sharded_zarr.write_jobs(array_dir, layout, leaf.data, array)]
            # Round robin over the files: writes to one file wait for each other on most file systems.
            jobs = [self._io.submit(job) for wave in itertools.zip_longest(*files) for job in wave if job is not None]
            for job in jobs:
                job.result()
            _touch(written[self.process])
            if self.process == 0:
                self._wait(lambda: all(os.path.exists(w) for w in written), step,
                           f"every process to write checkpoint {path}")
                self._commit(path)
                for marker in [markers.format("ready"), *written]:
                    os.remove(marker)
                if self.cfg.keep:  # and the one before the newest, whose loss is known finite (KEEP_AT_LEAST)
                    self._delete(self.complete_steps()[: -max(self.cfg.keep, KEEP_AT_LEAST)])
            else:
                self._wait(lambda: (self._attributes(step) or {}).get("write_completed") is True, step,
                           f"process 0 to commit checkpoint {path}")
        except BaseException:
            if os.path.isdir(path):
                _touch(markers.format("failed"))
            raise

    @staticmethod
    def _commit(path: str):
        """Sets the group's write_completed, atomically, in a folder that still exists (_replace_file_in)."""
        with open(os.path.join(path, "zarr.json")) as f:
            group = json.load(f)
        group["attributes"]["write_completed"] = True
        _replace_file_in(path, "zarr.json", json.dumps(group, indent=2).encode())

    def _wait(self, condition, step: int, what: str):
        failed = os.path.join(self.step_dir(step), f".failed.{self.token}")
        deadline, delay = time.monotonic() + MARKER_TIMEOUT_S, 0.001
        while not condition():
            if os.path.exists(failed):
                raise RuntimeError(f"another process failed to write checkpoint {self.step_dir(step)} (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {MARKER_TIMEOUT_S:.0f} s for {what}")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def check(self):
        """Raises here, in the training loop, the error of a background write that failed."""
        if self._in_flight is not None and self._in_flight.done():
            self.wait()

    def wait(self):
        """Blocks until the save in flight is committed; raises its error if it failed."""
        future, self._in_flight = self._in_flight, None
        if future is not None:
            try:
                future.result()
            except OSError as e:  # a full disk, a quota, a lost mount: the user can fix these
                if self._lock is not None:  # a run directory deleted under the write is the cause, not the file
                    run_lock.check_in_place(os.path.dirname(self.directory), self._lock)
                latest = self.latest_step()
                kept = (f"checkpoint {latest} is the newest and intact" if latest is not None
                        else "no checkpoint was committed")
                raise CheckpointError(f"writing a checkpoint in {self.directory} failed: "
                                      f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}; "
                                      f"{kept}; fix the cause and run the same command again to resume") from e
            except Exception as e:
                raise RuntimeError(f"writing a checkpoint in {self.directory} failed: {e!r}") from e

    def close(self):
        try:
            self.wait()
        finally:
            self._saver.shutdown()
            self._io.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, error_type, error, traceback):
        """Closes (the save in flight commits); a run that diverged ends with the way forward. When the run
        is already stopping for an error, that error is the one the user needs, not the save's."""
        try:
            self.close()
        except Exception:
            if error is None:
                raise
        if isinstance(error, DivergedError):
            raise self.diverged(error) from None

    def diverged(self, error: DivergedError) -> DivergedError:
        """`error` with what to do next. Checkpoint error.step, if saved, holds the state whose loss or
        gradient was not finite: it is renamed aside (`.diverged.<step>.*`), so that a restart resumes
        from the newest checkpoint whose loss was finite, which rotation kept (KEEP_AT_LEAST)."""
        aside = ""
        if self.process == 0 and error.step in self.complete_steps():
            moved = os.path.join(self.directory, f".diverged.{error.step:010d}.{uuid.uuid4().hex}")
            os.rename(self.step_dir(error.step), moved)
            aside = f"; checkpoint {error.step}, whose state gave it, is set aside as {moved}"
        latest = self.latest_step()
        remedy = "lower training.learning_rate (or muon_learning_rate, or raise warmup_steps)"
        then = (f"checkpoint {latest} is the newest whose loss was finite: {remedy} and run the same command to "
                f"resume from it" if latest is not None else f"no checkpoint was saved before it: {remedy} and run "
                "the same command to start again from step 0")
        return DivergedError(f"{error}{aside}; {then}", error.step)

    # ---- restoring ----

    def restore(self, shapes, shardings):
        """Loads the newest readable committed checkpoint as a tree like `shapes` (leaves with
        .shape and .dtype) placed with `shardings` (a tree of jax.sharding.Sharding), and moves
        every checkpoint newer than it out of the way, so that those steps are written afresh.
        Returns (step, tree), or None if there is no committed checkpoint. A damaged checkpoint
        is skipped (and renamed `.damaged.*` once an older one loads); a mismatch of names,
        shapes or dtypes that every checkpoint shares raises."""
        self.wait()
        names, treedef = leaf_names(shapes), jax.tree.structure(shapes)
        targets, placements = jax.tree.leaves(shapes), placements_of(shapes, shardings)
        complete, unreadable = self.complete_steps(), self._unreadable_steps()
        candidates, damaged = sorted(complete + unreadable), {}
        for step in reversed(candidates):
            try:
                if step in unreadable:
                    raise CorruptCheckpoint("its group metadata zarr.json is unreadable")
                leaves, problem = self._read(step, names, targets, placements), None
            except CorruptCheckpoint as e:
                leaves, problem = None, str(e)
            except StateMismatch as e:
                fitting = [s for s in complete if s != step and s not in damaged and self._fits(s, names, targets)]
                if not fitting:
                    raise
                leaves, problem = None, f"{e.what}, while checkpoint {fitting[-1]} fits the state"
            if _processes_agree(problem is None):
                self._discard_newer_than(step, damaged)
                return step, jax.tree.unflatten(treedef, leaves)
            damaged[step] = problem or "on another process"
        if candidates:
            if self.process == 0:
                for step, problem in damaged.items():
                    warn(f"checkpoint {self.step_dir(step)} is damaged ({problem})")
            raise CheckpointError(f"every committed checkpoint in {self.directory} is damaged "
                                  f"(steps {sorted(damaged)}); they are left in place: "
                                  "inspect them, then move them away to start again from step 0")
        self._discard_newer_than(-1, damaged)
        return None

    def _fits(self, step: int, names: list[str], targets: list) -> bool:
        """Whether checkpoint `step`'s metadata records exactly the state's arrays, shapes and dtypes."""
        attributes = self._attributes(step) or {}
        if sorted(attributes.get("arrays", [])) != sorted(names):
            return False
        for name, target in zip(names, targets):
            try:
                with open(os.path.join(self.step_dir(step), name, "zarr.json")) as f:
                    metadata = json.load(f)
                if (tuple(metadata["shape"]) != tuple(target.shape)
                        or metadata["attributes"]["dtype"] != jnp.dtype(target.dtype).name):
                    return False
            except (OSError, ValueError, KeyError, TypeError):
                return False
        return True

    def _discard_newer_than(self, step: int, damaged: dict):
        """Frees the steps after `step` for the resumed run: damaged checkpoints (`damaged`: step ->
        problem) are renamed aside for inspection, each with one warning; uncommitted ones deleted."""
        if self.process == 0 and os.path.isdir(self.directory):
            newer = [s for s in self._steps_on_disk() if s > step]
            for s in newer:
                if s in damaged:
                    aside = os.path.join(self.directory, f".damaged.{s:010d}.{uuid.uuid4().hex}")
                    os.rename(self.step_dir(s), aside)
                    warn(f"checkpoint {self.step_dir(s)} is damaged ({damaged[s]}); "
                         f"falling back to the previous one; it is kept as {aside}")
            uncommitted = [s for s in newer if s not in damaged]
            for s in uncommitted:  # said, since the user may have expected it (a save that a kill cut short)
                print(f"seqax: checkpoint {self.step_dir(s)} was never committed (write_completed is not true: its "
                      f"save was cut short): deleted; training goes on from step {max(step, 0)}", flush=True)
            self._delete(uncommitted)
        _barrier(f"seqax_checkpoint_discard_{step}")

    def read(self, step: int, shapes, shardings):
        """Checkpoint `step` as a tree like `shapes` (which may hold only some of its arrays, by
        name, e.g. {"weights": model} of a State), placed with `shardings`. Read only: unlike
        restore(), it moves and deletes nothing, so it is safe beside a running training."""
        if step not in self.complete_steps():
            raise CheckpointError(f"{self.step_dir(step)} is not a committed checkpoint; "
                                  f"the committed steps are {self.complete_steps()}")
        names, treedef = leaf_names(shapes), jax.tree.structure(shapes)
        try:
            leaves = self._read(step, names, jax.tree.leaves(shapes), placements_of(shapes, shardings), subset=True)
        except CorruptCheckpoint as e:
            if step not in self.complete_steps():  # a live run's rotation removed it while it was read: not damage
                raise CheckpointRemoved(f"checkpoint {self.step_dir(step)} was removed while it was read (the run's "
                                        "rotation, checkpoints.keep); read a newer one: the committed steps are now "
                                        f"{self.complete_steps()}") from e
            raise CheckpointError(f"checkpoint {self.step_dir(step)} is damaged: {e}") from e
        return jax.tree.unflatten(treedef, leaves)

    def read_or_warn(self, step: int, shapes, shardings, skipped: str):
        """read(), except that a damaged checkpoint (on any process) is one warning ending in `skipped`,
        what the caller does without it, and None: a resume whose catch-up evaluation needs an older
        checkpoint goes on without that evaluation, from the newest one, which restore() read whole."""
        names, treedef = leaf_names(shapes), jax.tree.structure(shapes)
        try:
            leaves, problem = self._read(step, names, jax.tree.leaves(shapes), placements_of(shapes, shardings),
                                         subset=True), None
        except CorruptCheckpoint as e:
            leaves, problem = None, str(e)
        if _processes_agree(problem is None):
            return jax.tree.unflatten(treedef, leaves)
        if self.process == 0:
            warn(f"checkpoint {self.step_dir(step)} is damaged ({problem or 'on another process'}); {skipped}")
        return None

    def _read(self, step: int, names: list[str], targets: list, shardings: list,
              subset: bool = False) -> list[jax.Array]:
        path = self.step_dir(step)
        attributes = self._attributes(step)
        if attributes is None:
            raise CorruptCheckpoint("its group metadata zarr.json is unreadable")
        if attributes.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {path} has format_version {attributes.get('format_version')!r}; "
                                  f"this program reads format_version {FORMAT_VERSION} only")
        if attributes.get("step") != step:
            raise CorruptCheckpoint(f"its step attribute is {attributes.get('step')!r}, "
                                    f"not the {step} of its directory name")
        stored = attributes.get("arrays", [])
        missing, extra = sorted(set(names) - set(stored)), sorted(set(stored) - set(names))
        if missing or (extra and not subset):
            what = f"arrays missing {missing}, unexpected {extra}"
            raise StateMismatch(f"checkpoint {path} does not hold this state: {what}; "
                                "it was written by another model or optimizer (the arrays its state holds); restore "
                                "with the code and config it was written with, or use a new paths.model_name", what)
        arrays = {}
        # absent in old checkpoints
        recorded_shapes, recorded_dtypes = attributes.get("array_shapes"), attributes.get("array_dtypes")
        for name, target in zip(names, targets):
            try:
                array = zarr.open_array(os.path.join(path, name), mode="r")
                dtype = jnp.dtype(array.attrs["dtype"])
            except Exception as e:  # zarr raises several types for damaged metadata
                raise CorruptCheckpoint(f"array {name}: {e!r}") from e
            if array.dtype != stored_dtype(dtype):
                raise CorruptCheckpoint(f"array {name} stores {array.dtype} but its dtype attribute says {dtype.name}")
            if recorded_shapes is not None and (list(array.shape) != recorded_shapes.get(name)
                                                or dtype.name != recorded_dtypes.get(name)):
                raise CorruptCheckpoint(f"array {name} is {dtype.name}{list(array.shape)} but the checkpoint recorded "
                                        f"{recorded_dtypes.get(name)}{recorded_shapes.get(name)} when it was saved")
            if tuple(array.shape) != tuple(target.shape) or dtype != target.dtype:
                what = (f"array {name} is {dtype.name}{list(array.shape)} "
                        f"but the state expects {jnp.dtype(target.dtype).name}{list(target.shape)}")
                raise StateMismatch(f"checkpoint {path}: {what}; "
                                    "use the model config it was written with or a new paths.model_name", what)
            arrays[name] = array
        return self._read_regions(path, arrays, names, targets, shardings)

    def _read_regions(self, path: str, arrays: dict, names: list[str], targets: list,
                      shardings: list) -> list[jax.Array]:
        """Each device's region of each array. Every chunk that overlaps a region held by this
        process is read once (with its shard's index first), then regions are assembled."""
        Z = sharded_zarr
        regions = {name: {Z.region(i, t.shape) for i in s.addressable_devices_indices_map(t.shape).values()}
                   for name, t, s in zip(names, targets, shardings)}
        needed = {(name, c): None
                  for name in names for r in regions[name] for c in Z.overlapping(r, arrays[name].chunks)}

        def results(jobs: dict) -> dict:
            try:
                return {key: job.result() for key, job in jobs.items()}
            except Z.DamagedChunk as e:
                raise CorruptCheckpoint(str(e)) from e
            except Exception as e:  # zarr's own checks of compressed chunks
                raise CorruptCheckpoint(repr(e)) from e

        def shard_of(name, c):
            a = arrays[name]
            return None if a.shards is None else tuple(i * n // s for i, n, s in zip(c, a.chunks, a.shards))

        shards = {(name, shard_of(name, c)) for name, c in needed if shard_of(name, c) is not None}
        indexes = results({(name, s): self._io.submit(Z.read_index, os.path.join(path, name), arrays[name], s)
                           for name, s in shards})
        def read(name, c):
            return Z.read_chunk(os.path.join(path, name), arrays[name], c, indexes.get((name, shard_of(name, c))))

        chunks = results({(name, c): self._io.submit(read, name, c) for name, c in needed})

        def assemble(name, r):
            covering = {c: chunks[name, c] for c in Z.overlapping(r, arrays[name].chunks)}
            if not covering:  # an empty array (the experts of a dense model) has no chunk
                return np.empty([b - a for a, b in r], jnp.dtype(arrays[name].attrs["dtype"]))
            return Z.assemble(r, arrays[name].chunks, covering).view(jnp.dtype(arrays[name].attrs["dtype"]))

        data = results({(name, r): self._io.submit(assemble, name, r) for name in names for r in regions[name]})
        handed_out = set()

        def block(name, shape, index):  # a CPU device may adopt the buffer: each device gets its own
            key = (name, Z.region(index, shape))
            fresh = key not in handed_out
            handed_out.add(key)
            return data[key] if fresh else data[key].copy()

        return [jax.make_array_from_callback(t.shape, sharding, partial(block, name, t.shape))
                for name, t, sharding in zip(names, targets, shardings)]
