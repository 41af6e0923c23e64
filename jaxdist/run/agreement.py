"""One run, one config: before the first step, every process compares what shapes the run
with process 0's, and a difference stops every process in one line.

What is compared: the resolved config (every field, derived ones included), the recipe
file's contents, the jaxdist version, the mesh and the device counts. Processes of one run
given different ``--set`` values, recipe files or installs would otherwise train a mix (a
different weight decay trains silently; a different batch size fails only inside a later
step). Nothing is compared with one process.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from jaxdist import __version__
from jaxdist.run.config import ConfigError
from jaxdist.run.rerun import MISSING, flatten

__all__ = ["ProcessesDisagreeError", "check_same_everywhere", "run_facts", "text_from_process_0"]


class ProcessesDisagreeError(ConfigError):
    """The processes of one run were given different configs, recipes or installs."""


def run_facts(
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, recipe: Path | None = None
) -> dict[str, Any]:
    """Dotted name -> value of everything that must be the same on every process."""
    facts = {f"config.{k}": v for k, v in flatten(config).items()}
    facts["jaxdist.version"] = __version__
    facts["mesh"] = ",".join(f"{axis}={size}" for axis, size in mesh.shape.items())
    facts["devices"] = jax.device_count()
    facts["processes"] = jax.process_count()
    if recipe is not None:
        facts["recipe file"] = hashlib.sha256(Path(recipe).read_bytes()).hexdigest()[:16]
    return facts


def text_from_process_0(text: str) -> str:
    """Process 0's ``text``, on every process (a collective: every process calls it)."""
    from jax.experimental import multihost_utils

    data = np.frombuffer(text.encode(), np.uint8)
    size = int(np.asarray(multihost_utils.broadcast_one_to_all(np.int32(len(data)))))
    buffer = np.zeros(max(size, 1), np.uint8)  # every process sends a buffer of one size
    buffer[: min(len(data), size)] = data[:size]
    shared = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return bytes(shared[:size].astype(np.uint8)).decode()


def check_same_everywhere(facts: dict[str, Any]) -> None:
    """A collective: every process calls it. Raises :class:`ProcessesDisagreeError` on every
    process, naming the processes and keys that differ from process 0's, when any does."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    reference = json.loads(text_from_process_0(json.dumps(facts, sort_keys=True)))
    keys = sorted(reference)
    differs = [reference[k] != facts.get(k, MISSING) for k in keys]
    differs.append(bool(set(facts) - set(reference)))  # keys process 0 does not have
    masks = np.asarray(multihost_utils.process_allgather(np.array(differs, np.uint8)))
    masks = masks.reshape(jax.process_count(), len(keys) + 1)
    if not masks.any():
        return
    named = []
    for process, mask in enumerate(masks):
        if mask.any():
            names = [keys[i] for i in np.flatnonzero(mask[:-1])]
            names += ["keys process 0 lacks"] if mask[-1] else []
            named.append(f"process {process}: {', '.join(names)}")
    raise ProcessesDisagreeError(
        f"the processes of this run differ from process 0 in what shapes it ({'; '.join(named)}); "
        "give every process the same recipe, --set values and jaxdist install"
    )
