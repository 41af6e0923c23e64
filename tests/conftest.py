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
# machine to themselves (marked `multiprocess`: JAX peers that compile and must meet) takes
# every slot below and runs with nothing beside it; one that starts a single child it races
# or times (marked `beside_one`: a kill during a write, a watchdog) runs beside at most one
# other test. Tests whose processes only sleep, or exit after a fixed wait, run beside others.
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
    "test_aot",
    "test_pipeline_step",
    "test_tensor_parallel",
    "test_collectives",
    "test_faults",
    "test_tasks",
    "test_sharded_step",
    "test_train_step",
    "test_schedulers",
    "test_pipeline_trainer",
    "test_pipeline_fsdp",
    "test_trainer",
    "test_sufficient_factors",
    "test_multiprocess",
    "test_pipeline_async",
    "test_mlperf_log",
    "test_recipes",
    "test_rerun",
)


# What share of the machine a test needs, in slots: one per xdist worker. A test marked
# `multiprocess` takes every slot and runs alone; one marked `beside_one` (a single child it
# races or times, which uses about one core of the two) takes all but one, so at most one
# other test runs beside it; every other test takes one.
SLOTS = 3


def _slots_needed(item) -> int:
    if item is None:
        return 0
    if item.get_closest_marker("multiprocess") is not None:
        return SLOTS
    if item.get_closest_marker("beside_one") is not None:
        return SLOTS - 1
    return 1


def pytest_collection_modifyitems(config, items):
    # Files stay whole; within a file the tests that need more than a slot come last, the
    # heaviest at the end, so that the slots change hands once per kind (the order within each
    # kind stays).
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(
        key=lambda item: (rank.get(item.path.stem, len(rank)), item.path, _slots_needed(item))
    )


@contextlib.contextmanager
def _take_slots(needed: int):
    """Hold ``needed`` of the slot files (flock), fair to the test that needs many: each test
    passes the turnstile first and keeps it until it holds its slots, so that no test starts
    while one that needs several waits for them. A one-slot test takes any free slot, the last
    first; one that needs several takes the first ones, in order (no deadlock: a test waits
    for slots only while it holds the turnstile, and holders never need the turnstile)."""
    folder = os.environ["JAXDIST_TEST_LOCKS"]
    turnstile = os.open(os.path.join(folder, "turnstile"), os.O_CREAT | os.O_RDWR)
    slots = [
        os.open(os.path.join(folder, f"slot{i}"), os.O_CREAT | os.O_RDWR) for i in range(SLOTS)
    ]
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if needed == 1:
            for slot in reversed(slots):
                try:
                    fcntl.flock(slot, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    continue
            else:  # more workers than slots: wait for the last one
                fcntl.flock(slots[-1], fcntl.LOCK_EX)
        else:
            for slot in slots[:needed]:
                fcntl.flock(slot, fcntl.LOCK_EX)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
    finally:
        for descriptor in (*slots, turnstile):
            os.close(descriptor)  # closing a descriptor releases its lock


class _HeldSlots:
    """Several slots, kept from one test that needs them to the next that needs as many:
    between two of them another worker would start a test, and the second would wait for it."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.held = 0

    def take(self, needed: int) -> None:
        if self.held != needed:
            self.give_back()
            self._stack.enter_context(_take_slots(needed))
            self.held = needed

    def give_back(self) -> None:
        self._stack.close()
        self.held = 0


_held = _HeldSlots()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    needed = _slots_needed(item)
    if needed == 1:
        with _take_slots(1):
            yield
        return
    _held.take(needed)
    try:
        yield
    finally:
        if _slots_needed(nextitem) != needed:
            _held.give_back()


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, f"tests expect 8 CPU devices, found {jax.device_count()}"
