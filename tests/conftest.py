"""Tests run on 8 simulated CPU devices; this must happen before jax is imported.

Each pytest process (one, or each of `make test`'s pytest-xdist workers) runs many tests, so every
test must leave that process as it found it: no mesh still set, no profiler trace still running,
no thread it started still alive, no function of ours or of JAX replaced, no signal handler,
environment variable, working directory or JAX option changed. The check after each test (and
after each module, for module fixtures) turns a leak into an error of the test that leaked,
instead of a crash of a later one, and puts back what it can. Each module's compiled programs are
dropped after it, so that the process does not accumulate them (a profile, for one, holds every live program)."""

import atexit
import gc
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
# One persistent compilation cache for the whole test run: this pytest process, the other pytest-xdist
# workers of the same run and the child processes they all start. About 60 child runs train a few tiny
# configs and would each compile the same step, init and eval programs again (about 15 s a run on 2
# cores), and each worker would compile what the other already has. A cached program is the same
# program: losses, reports and files do not change. The folder of an xdist run is named by the run's id
# (set before this file is imported) and removed by the controlling process at the end
# (pytest_unconfigure); without xdist, a new folder removed at exit. JAX writes an entry without a lock:
# a process that reads one still being written warns and compiles (jax's compiler._cache_read). Its
# lock (on with a size limit) is left off: with it, the TPU interpret-mode test left a thread of XLA's
# registered as a Python thread ('Dummy-2'), and test_flash_attention took 38 s instead of 28 s.
CACHE_PREFIX = os.path.join(tempfile.gettempdir(), "seqax-tests-jax-cache-")
if os.environ.get("PYTEST_XDIST_TESTRUNUID"):
    COMPILATION_CACHE = CACHE_PREFIX + os.environ["PYTEST_XDIST_TESTRUNUID"]
    os.makedirs(COMPILATION_CACHE, exist_ok=True)
else:
    COMPILATION_CACHE = tempfile.mkdtemp(prefix=os.path.basename(CACHE_PREFIX))
    atexit.register(shutil.rmtree, COMPILATION_CACHE, ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = COMPILATION_CACHE
# also what modules compile again after jax.clear_caches()
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import pytest  # noqa: E402

THREAD_EXIT_SECONDS = 5  # how long a test's threads may take to finish after it returns
# Threads that a library starts on first use and keeps for the life of the process: zarr's event
# loop and the workers of that loop's default executor, tqdm's monitor of progress bars, and XLA:CPU's
# worker threads once one has run Python (a host callback: Mosaic GPU's interpret mode makes them), which
# Python lists as Dummy-N.
LIBRARY_THREADS = ("zarr_io", "asyncio_", "tqdm_monitor", "Dummy-")
# Environment variables that pytest or a library sets for itself on import: torch; scikit-learn
# (lm-eval's, which `datasets` imports where it is installed); tensorboardX (its CRC32C mode, as train.py's
# records import it); JAX's Mosaic GPU, which Pallas imports when it first lowers a kernel (its MOSAIC_GPU_*
# paths: jax 0.11 with a CUDA plugin sets several).
OWN_VARIABLES = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK", "CRC32C_SW_MODE",
                 "MOSAIC_GPU_")
# Modules whose functions tests monkeypatch (always undone by the monkeypatch fixture).
PATCHED_MODULES = ("jax", "jax.nn", "jax.numpy", "jax.lax", "jax.random", "jax.profiler", "shutil")


def own_variable(name: str) -> bool:
    """Whether an environment variable is one that OWN_VARIABLES names (a name, or a prefix of several)."""
    return name.startswith(OWN_VARIABLES)


def functions() -> dict:
    """Every function and class of our modules and of PATCHED_MODULES, by where it is reached."""
    ours = [m for name, m in list(sys.modules.items())
            if getattr(m, "__file__", None) and m.__file__.startswith(ROOT + os.sep)
            and f"{os.sep}tests{os.sep}" not in m.__file__ and f"{os.sep}.venv{os.sep}" not in m.__file__]
    modules = ours + [sys.modules[name] for name in PATCHED_MODULES if name in sys.modules]
    return {f"{m.__name__}.{k}": v for m in modules for k, v in list(vars(m).items())
            if callable(v) or isinstance(v, type)}


def process_state() -> dict:
    return {
        "environment variables": {k: v for k, v in os.environ.items() if not own_variable(k)},
        "working directory": os.getcwd(),
        "SIGTERM handler": signal.getsignal(signal.SIGTERM),
        "SIGINT handler": signal.getsignal(signal.SIGINT),
        "JAX options": dict(jax.config.values),
        "functions": functions(),
        "mesh": jax.sharding.get_mesh(),
    }


def changes(before: dict, after: dict) -> list[str]:
    found = []
    for what, value in before.items():
        if isinstance(value, dict):
            # A function that appears later is in a module imported meanwhile, not a change.
            keys = value.keys() if what == "functions" else value.keys() | after[what].keys()
            changed = sorted(k for k in keys
                             if after[what].get(k) is not value.get(k) and after[what].get(k) != value.get(k))
            found += [f"{what}: {k} was {value.get(k)!r}, is {after[what].get(k)!r}" for k in changed]
        elif value != after[what]:
            found.append(f"{what} was {value!r}, is {after[what]!r}"
                         + (" (use `with jax.set_mesh(mesh):`)" if what == "mesh" else ""))
    return found


def restore(state: dict):
    """Puts back what process_state() recorded, so that one leak fails one test, not every later one."""
    own = {k: v for k, v in os.environ.items() if own_variable(k)}
    os.environ.clear()
    os.environ.update(state["environment variables"], **own)
    os.chdir(state["working directory"])
    signal.signal(signal.SIGTERM, state["SIGTERM handler"])
    signal.signal(signal.SIGINT, state["SIGINT handler"])
    for name, value in state["JAX options"].items():
        if jax.config.values.get(name) != value:
            jax.config.update(name, value)
    for name, value in state["functions"].items():
        module, attribute = name.rsplit(".", 1)
        setattr(sys.modules[module], attribute, value)
    jax.set_mesh(state["mesh"])


def threads_left(before: set) -> list[threading.Thread]:
    """The threads started since `before` that are still alive after a grace period."""
    deadline = time.monotonic() + THREAD_EXIT_SECONDS
    while True:
        alive = [t for t in threading.enumerate()
                 if t not in before and t.is_alive() and not t.name.startswith(LIBRARY_THREADS)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


def check_unchanged(threads: set, state: dict, who: str):
    problems = changes(state, process_state())
    if problems:
        restore(state)
    try:
        jax.profiler.stop_trace()
        problems.append("a profiler trace was still running (now stopped)")
    except RuntimeError:  # "No profile started": the state we want
        pass
    problems += [f"thread {t.name!r} is still running (close what started it)" for t in threads_left(threads)]
    if problems:
        pytest.fail(f"{who} left the process changed:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.fixture(scope="session")
def default_dataset(tmp_path_factory) -> str:
    """tools/write_synthetic_dataset.py's dataset with the tool's defaults (what `make train`
    uses), written once for the session (about 6 s on 2 cores): the tests that need the full
    size only read it."""
    from fixtures import synthetic_dataset

    return synthetic_dataset(tmp_path_factory.mktemp("default_dataset") / "synthetic.zarr")


def pytest_configure(config):
    """The process that controls pytest-xdist's workers names the run itself (xdist's --testrunuid), so that
    it knows which compilation cache folder its workers share and can remove it at the end."""
    if not hasattr(config, "workerinput") and hasattr(config.option, "testrunuid") and not config.option.testrunuid:
        config.option.testrunuid = uuid.uuid4().hex


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and getattr(config.option, "testrunuid", None):
        shutil.rmtree(CACHE_PREFIX + config.option.testrunuid, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def module_leaves_the_process_as_it_found_it():
    """The same for what a module's fixtures start and stop (set up before the module's tests)."""
    threads, state = set(threading.enumerate()), process_state()
    yield
    check_unchanged(threads, state, "the module's fixtures")
    jax.clear_caches()  # the next module compiles what it needs; nothing piles up over ~250 tests
    gc.collect()


@pytest.fixture(autouse=True)
def leaves_the_process_as_it_found_it():
    threads, state = set(threading.enumerate()), process_state()
    yield
    check_unchanged(threads, state, "the test")
