"""Test set-up: 8 forced CPU devices, set before JAX is imported anywhere, and one compilation
cache for the whole run."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
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

import jax
import pytest


def pytest_configure(config):
    # Executables compiled for TPU slices that are not here (jaxdist.aot) are written to the
    # cache but cannot be read back without a TPU client; JAX then warns and compiles again,
    # which is what it would do without the cache.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Error reading persistent compilation cache entry.*PjRtCompiler must be "
        "constructed with a Client:UserWarning",
    )


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, f"tests expect 8 CPU devices, found {jax.device_count()}"
