"""Test set-up: 8 forced CPU devices, set before JAX is imported anywhere, one compilation
cache for the whole run, and tests that start processes run alone."""

import atexit
import contextlib
import fcntl
import os
import shutil
import tempfile

from tests._procs import COMPILE_FLAGS

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8", *COMPILE_FLAGS]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Many tests compile the same programs: the trainer's step for the same tiny recipe, in this
# process and in the `jaxdist` processes tests start. JAX's persistent compilation cache,
# in a folder of this run's own (inherited by those processes through the environment),
# compiles each of them once. Programs that compile in under 0.2 s are not worth a file.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxdist-tests-compilation-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# The run uses three pytest-xdist workers on two cores: most tests are one XLA compile after
# another, but many also wait (for the processes they start to import JAX and meet, for a
# file, for a child to exit), and a third worker fills those waits: on 2 cores the default
# run took 15 min 08 s with three workers, 17 min 15 s with two. A test whose processes need the
# machine to themselves (marked `multiprocess`: JAX peers that compile and must meet, a race
# with a child, a watchdog's time limit) takes the lock below exclusively and runs with
# nothing beside it, while every other test shares it. Tests whose processes only sleep, or
# exit after a fixed wait, run beside others.
if "JAXDIST_TEST_LOCKS" not in os.environ:
    _locks = tempfile.mkdtemp(prefix="jaxdist-tests-locks-")
    atexit.register(shutil.rmtree, _locks, ignore_errors=True)
    os.environ["JAXDIST_TEST_LOCKS"] = _locks

import jax
import pytest


def pytest_configure(config):
    # An executable a test compiles itself for a TPU slice that is not here is written to the
    # cache but cannot be read back without a TPU client (jaxdist.aot's compiles keep theirs
    # out); JAX then warns and compiles again, which is what it would do without the cache.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Error reading persistent compilation cache entry.*PjRtCompiler must be "
        "constructed with a Client:UserWarning",
    )


# xdist hands whole files to the workers in collection order (`--no-loadscope-reorder`):
# the files that take longest go first, so that neither worker is left with one of them at
# the end. Any file not named keeps its place after these.
LONGEST_FIRST = (
    "test_aot", "test_faults", "test_pipeline_step", "test_sufficient_factors",
    "test_pipeline_trainer", "test_collectives", "test_multiprocess", "test_train_step",
    "test_mlperf_log", "test_recipes", "test_lowered_programs", "test_trainer", "test_rerun",
)  # fmt: skip


def _runs_alone(item) -> bool:
    return item is not None and item.get_closest_marker("multiprocess") is not None


def pytest_collection_modifyitems(config, items):
    # Files stay whole; within a file the tests that run alone come last, one after another,
    # so that the lock below changes hands once per file (the order within each group stays).
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.stem, len(rank)), item.path, _runs_alone(item)))


@contextlib.contextmanager
def _run_alone_or_beside(alone: bool):
    """A reader-writer lock over two files, fair to the writer: each test passes the
    turnstile first, and a test that must run alone holds the turnstile until every test
    running beside it has finished, so that no new one starts meanwhile."""
    folder = os.environ["JAXDIST_TEST_LOCKS"]
    turnstile = os.open(os.path.join(folder, "turnstile"), os.O_CREAT | os.O_RDWR)
    shared = os.open(os.path.join(folder, "running"), os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if alone:
            fcntl.flock(shared, fcntl.LOCK_EX)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(shared, fcntl.LOCK_SH)
        yield
    finally:
        os.close(shared)  # closing a descriptor releases its lock
        os.close(turnstile)


class _HeldAlone:
    """The exclusive lock, kept from one test that runs alone to the next: between two of
    them the other worker would start a test, and the second would wait for it to end."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.held = False

    def take(self) -> None:
        if not self.held:
            self._stack.enter_context(_run_alone_or_beside(True))
            self.held = True

    def give_back(self) -> None:
        self._stack.close()
        self.held = False


_alone = _HeldAlone()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _runs_alone(item):
        with _run_alone_or_beside(False):
            yield
        return
    _alone.take()
    try:
        yield
    finally:
        if not _runs_alone(nextitem):
            _alone.give_back()


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, f"tests expect 8 CPU devices, found {jax.device_count()}"
