"""Helpers for tests that start processes: a clean environment and a /proc orphan check."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "tests" / "multiprocess_worker.py")
JAXDIST = [sys.executable, "-m", "jaxdist"]

# Tests check what programs compute, not how fast XLA:CPU's code runs them: LLVM's
# optimisations take a third of each compile and change no result a test checks. Every test
# process, this one (conftest) and those it starts (clean_env), compiles with these.
COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment minus what conftest forced (8 devices) and any process-group setting:
    each child chooses its own device count. It keeps the tests' compile flags; an
    ``XLA_FLAGS`` given here is added to them."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAXDIST_") and k not in ("XLA_FLAGS", "JAX_PLATFORMS")
    }
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO)
    env["XLA_FLAGS"] = " ".join([*COMPILE_FLAGS, extra.pop("XLA_FLAGS", "")]).strip()
    env.update(extra)
    return env


def processes_with_env(token: str) -> list[int]:
    """Pids of live processes whose environment contains ``token`` (e.g. a unique marker)."""
    found = []
    needle = token.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                status = (entry / "status").read_text()
                if "\nState:\tZ" not in status:  # zombies hold nothing and cannot be killed
                    found.append(int(entry.name))
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return found
