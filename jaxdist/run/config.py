"""Recipes: Python files whose ``get_config()`` returns an ``ml_collections.ConfigDict``.

A recipe states what it reproduces, the command, the hardware and the expected result in its
docstring, and computes derived values itself (the learning rate from the batch size, ...),
preferably as ``FieldReference`` arithmetic so that ``--set batch_size=...`` moves them too::

    config.batch_size = 1024
    config.lr.peak = config.get_ref("lr_base") * config.get_ref("batch_size") / 256

:func:`load_recipe` imports a recipe by path (or by name from ``recipes/``) and
:func:`apply_overrides` applies ``key=value`` strings with the config's own type checking: a
value must have the type of the field it replaces (ints are accepted for floats), and an
unknown key is an error that names the nearest known keys.

The fields the trainer reads are listed in :data:`REQUIRED_KEYS`; :func:`base_config`
provides them all with defaults, and a recipe starts from it and changes what it needs.

Fields:

  model: ``name`` (``jaxdist.models`` registry), ``width``, ``stem``, ``dtype``
    (``float32``/``bfloat16``), ``zero_init_last_bn_scale``, ``pointwise_matmul`` (1x1
    convolutions as matrix products, see :class:`jaxdist.models.ResNet`), BatchNorm
    ``bn_momentum``, ``bn_epsilon`` and ``bn_group_size`` (devices per statistics group:
    ``None`` = the whole data axis, 1 = per-device BN).
  data: :class:`jaxdist.data.DataConfig` fields.
  mesh: a preset in ``meshes/``, a path to a mesh TOML, or axes inline
    (``data=2,fsdp=2,tensor=2``: each axis's name is its role, :mod:`jaxdist.meshes`); ``""``
    = one axis over all devices (``data x stage`` over all of them when ``pipeline.stages``
    is set).
  allreduce, bucket_bytes: gradient averaging (:class:`jaxdist.training.train_step.TrainStep`);
    ``allreduce="auto"`` chooses a schedule per bucket and sufficient factors per dense
    layer by the cost model on ``links``.
  links: ``LATENCY:BANDWIDTH`` or a ``jaxdist bench allreduce --json`` file of the mesh
    (``""``: the emulated cluster's link, if any); what ``auto`` prices on.
  sfb_layers: dense layers whose gradients travel as sufficient factors: ``""`` (none;
    with ``auto``, every dense layer is a candidate), ``"all"``, ``"none"`` or
    comma-separated module paths such as ``"head"``.
  transfer_dtype: the dtype the gradients travel in (``""``: each gradient's own;
    ``"bfloat16"``: half the bytes, and half the buffer a reduce-scatter holds). The permute
    schedules add the messages up in float32; XLA's own collectives (``native``) sum in the
    dtype they travel in, as XLA's FSDP of a bfloat16 model does.
  unroll_limit: ring steps an allreduce schedule runs unrolled along one axis; a longer
    ring runs as a loop, which compiles in the same time at any size but lets no backward
    compute overlap that axis's steps (docs/planning.md).
  sharding: ``replicated`` (every device holds the whole model and optimizer state), ``zero1``
    (the optimizer state and update sharded) or ``fsdp`` (parameters too, each gather unit
    all-gathered as the loss reads it); see :mod:`jaxdist.training.sharding`. The
    reduce-scatters and all-gathers run ``allreduce``'s halves. On a mesh with an axis named
    ``fsdp`` the state is sharded over that axis alone and the other axes are data-parallel
    replicas (HSDP). With pipeline stages, ``fsdp`` splits each stage's state over the data
    axes and gathers it once a step (:mod:`jaxdist.pipeline.fsdp`); ``zero1`` is refused.
  gather: the schedule of the parameters' all-gathers under ``zero1`` and ``fsdp`` when it is
    not ``allreduce``'s (``""``): ``native`` beside a permute ``allreduce`` gathers with XLA's
    all-gather and reduce-scatters the gradients with the schedule.
  prefetch: under ``fsdp``, how many layers ahead of its use a layer's all-gather may start,
    in forward and in backward (1: beside the layer before); more gives each gather more
    compute to hide behind and holds that many more layers gathered.
  scatter_behind: under ``fsdp`` with scanned layers, each layer's gradient is
    reduce-scattered during the backward of the layer before it, hidden behind its compute,
    for one layer's whole gradient more in memory (``False``: at the end of its own).
  logical_axis_rules: ``name=axis`` pairs, comma-separated and ordered, mapping the model's
    named parameter dimensions to the mesh's ``tensor`` and ``fsdp`` axes (MaxText's
    semantics, :mod:`jaxdist.training.logical_axes`); heads, key/value heads and MLP units
    over the ``tensor`` axis (if the mesh has one) after them; ``vocab=tensor`` splits the
    vocabulary too (:mod:`jaxdist.comm.vocab_parallel`). With no rule for ``fsdp``, FSDP
    and ZeRO-1 split each parameter by its shape.
  tensor_schedule: how a ``tensor`` axis's partial products are summed: ``native`` (XLA's
    all-reduce) or ``collective_matmul`` (a reduce-scatter with the product inside it, then
    an all-gather; :mod:`jaxdist.comm.collective_matmul`).
  tensor_sequence: sequence parallelism: norms, residual stream and dropout split along the
    sequence over the ``tensor`` axis between its products, each sum then a reduce-scatter
    and each input an all-gather (:mod:`jaxdist.comm.tensor_parallel`).
  wait_free: run every gradient bucket's schedule beside the rest of the backward pass, one
    message step per matrix product, in the compiled program's own order (wait-free
    backprop, :mod:`jaxdist.training.wait_free`); a permute schedule's steps then run
    unrolled whatever ``unroll_limit`` says.
  batch_size, batch_ramp: global batch; ``batch_ramp`` holds ``(until_epoch, batch)``
    pairs run before ``batch_size`` (see :func:`batch_stages`).
  max_per_device_batch: larger per-device batches are split into accumulation steps.
  num_epochs: training length; the LR schedule ends there.
  optimizer: ``name`` (``sgd``/``lars``/``adamw``) and its hyperparameters (``momentum``,
    ``nesterov``, ``weight_decay``, ``trust_coefficient``, ``eps``, Adam's ``b1``, ``b2``);
    ``eps`` left at ``None`` is the chosen optimizer's own (adamw ``1e-8``, lars ``0``);
    ``clip_norm`` > 0 first scales each step's gradients down to that global L2 norm (over the
    whole model, whatever the sharding or pipeline stages).
  lr: ``kind`` and arguments of :func:`jaxdist.training.optim.lr_schedule` (in epochs).
  label_smoothing: for the cross-entropy.
  eval_every_epochs, eval_batch_size: periodic top-1/top-5 on the held-out split.
  checkpoint: ``every_steps`` (0: only at the end), ``keep`` (last k), ``async_save``.
  log_every_steps: progress line and metrics record interval.
  seed: parameter init, data order and augmentation.
  target_accuracy: top-1 at which the event log's ``run_stop`` says ``success``.
  max_steps: stop after this many steps in total (0: run all epochs); for smoke runs.
  skip_nonfinite_steps: 0 stops the run at the first step whose loss is not finite, keeping
    the last checkpoint saved before it; N > 0 skips such steps instead (the model stays as it
    was, as loss scaling does) and stops only after N of them in a row.
  tensorboard: ``"auto"`` writes TensorBoard summaries to ``WORKDIR/tensorboard`` when the
    writer is installed (``pip install 'jaxdist[tensorboard]'``), ``"on"`` requires it,
    ``"off"`` never writes (:mod:`jaxdist.run.tensorboard`).
  watchdog_s: a process that finishes no step (and reads no batch) for this long reports
    which step it is stuck in and what it waits for, writes every thread's stack to
    ``WORKDIR/stuck-p<process>.txt`` and exits; compiling and evaluating are exempt.
    0 disables it.
  mlperf: what the MLPerf event log (:mod:`jaxdist.run.mlperf`) reports about the submission:
    ``org``, ``platform`` (``""``: ``<devices>x<device kind>``), ``division`` (``closed`` /
    ``open``), ``status`` (``cloud``, ``onprem``, ``preview``, ``research``), ``benchmark``
    (``""``: ``resnet`` for ResNet-50, else the model's name) and ``cache_cleared`` (set it
    when the launch script dropped the page cache before the run, as MLPerf's rules ask).
  pipeline: ``stages`` (0: no pipeline; else the size of the mesh's ``stage`` axis),
    ``microbatches`` per data-parallel replica and step, ``schedule`` (``gpipe``, ``1f1b``,
    ``interleaved``), ``chunks`` (model chunks per device, interleaved only) and
    ``boundaries`` (the first layer of each virtual stage; ``()``: equal stages; ``"auto"``:
    the cut :mod:`jaxdist.pipeline.partition` chooses from a layer profile, recorded in the
    workdir's ``config.json`` so that a rerun keeps it) and ``profile`` (the profile
    ``"auto"`` reads, from ``jaxdist pipeline profile``; ``""``: measure one at start). See
    :mod:`jaxdist.pipeline`.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import ml_collections

__all__ = [
    "ConfigError",
    "apply_overrides",
    "base_config",
    "batch_stages",
    "load_recipe",
    "recipe_task",
    "refuse_unread",
]

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"

# Fields of another type that also take these words.
STRING_CHOICES = {"pipeline.boundaries": ("auto",)}

# Top-level fields every recipe must define (base_config() has them all).
REQUIRED_KEYS = (
    "model",
    "data",
    "mesh",
    "allreduce",
    "batch_size",
    "batch_ramp",
    "max_per_device_batch",
    "num_epochs",
    "optimizer",
    "lr",
    "label_smoothing",
    "eval_every_epochs",
    "eval_batch_size",
    "checkpoint",
    "log_every_steps",
    "seed",
    "target_accuracy",
    "max_steps",
)


class ConfigError(ValueError):
    """A recipe, an override or a config value is malformed."""

    exit_code = 2  # the command line's usage error


@contextlib.contextmanager
def config_problems():
    """A ValueError or TypeError while building from the config is a bad config value: one
    :class:`ConfigError` (the original chained). Errors that carry their own ``exit_code``,
    such as a missing dataset, pass unchanged."""
    try:
        yield
    except (ValueError, TypeError) as err:
        if hasattr(err, "exit_code"):
            raise
        raise ConfigError(f"the config cannot run here: {err}") from err


def resolve_recipe_path(recipe: str | Path) -> Path:
    """A path to a recipe file; a bare name (``mnist_small_batch``) is looked up in ``recipes/``."""
    path = Path(recipe)
    if path.suffix != ".py" and not path.exists():
        path = RECIPES_DIR / f"{recipe}.py"
    if not path.is_file():
        known = sorted(p.stem for p in RECIPES_DIR.glob("*.py") if not p.stem.startswith("_"))
        raise ConfigError(f"recipe {str(recipe)!r} not found (looked for {path}); known: {known}")
    return path


def _import_recipe(path: Path) -> Any:
    """The recipe file's module, run once per process (its ``get_config`` and ``get_task``
    are read from the same module)."""
    key = (str(path.resolve()), path.stat().st_mtime_ns)
    if key in _RECIPE_MODULES:
        return _RECIPE_MODULES[key]
    spec = importlib.util.spec_from_file_location(f"jaxdist_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        line = (err.text or "").strip()
        raise ConfigError(
            f"recipe {path}: invalid Python at line {err.lineno}: {err.msg}: {line!r}"
        ) from err
    _RECIPE_MODULES[key] = module
    return module


_RECIPE_MODULES: dict[tuple[str, int], Any] = {}


def recipe_task(recipe: str | Path) -> Callable[..., Any] | None:
    """The recipe's ``get_task(config, replicas)`` (:mod:`jaxdist.tasks`), or ``None`` for a
    recipe that trains the default image classification task."""
    path = resolve_recipe_path(recipe)
    get_task = getattr(_import_recipe(path), "get_task", None)
    if get_task is not None and not callable(get_task):
        raise ConfigError(f"recipe {path}: get_task must be a function (config, replicas) -> Task")
    return get_task


def load_recipe(recipe: str | Path) -> ml_collections.ConfigDict:
    """Import the recipe file and return its ``get_config()``, checked for required keys."""
    path = resolve_recipe_path(recipe)
    module = _import_recipe(path)
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError(f"recipe {path} defines no get_config() function")
    try:
        config = module.get_config()
    except Exception as err:  # the recipe's own code failed: name it, keep the cause chained
        raise ConfigError(
            f"recipe {path}: get_config() raised {type(err).__name__}: {err}"
        ) from err
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(
            f"recipe {path}: get_config() must return an ml_collections.ConfigDict, "
            f"got {type(config).__name__}"
        )
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if missing:
        raise ConfigError(f"recipe {path} lacks required keys {missing}")
    return config


def flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Dotted names of every leaf field (``data.source``, ``lr.peak``, ...)."""
    keys = []
    for name in config:
        value = config[name]
        if isinstance(value, ml_collections.ConfigDict):
            keys += flat_keys(value, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _parse_value(text: str, current: Any) -> Any:
    """The override ``text`` as a Python value shaped like ``current``."""
    if isinstance(current, str):
        return text  # strings need no quotes: --set data.source=synthetic
    if isinstance(current, bool):
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(f"expected a boolean (true/false), got {text!r}")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # a bare word: only acceptable where the field is None or a string
    if isinstance(current, tuple) and isinstance(value, list):
        value = tuple(value)
    return value


def _a(noun: str) -> str:
    """``noun`` with its indefinite article: "an int", "a float"."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


# Optimizer hyperparameters each optimizer takes from config.optimizer.
OPTIMIZER_FIELDS = {
    "sgd": ("momentum", "nesterov", "weight_decay"),
    "adamw": ("b1", "b2", "eps", "weight_decay"),
    "lars": ("momentum", "nesterov", "weight_decay", "trust_coefficient", "eps"),
}
# Schedule fields each lr.kind reads beyond kind, peak, warmup_epochs and init_lr.
LR_KIND_FIELDS = {
    "cosine": ("end_lr",),
    "poly": ("end_lr", "power"),
    "constant": (),
    "step": ("step_epochs", "step_factor"),
}
# A field that chooses what reads the rest of its section: (the fields each choice reads,
# the fields every choice reads). Without pipeline stages no other pipeline field is read.
SWITCHES = {
    "optimizer.name": (OPTIMIZER_FIELDS, ("name", "clip_norm")),
    "lr.kind": (LR_KIND_FIELDS, ("kind", "peak", "warmup_epochs", "init_lr")),
    "pipeline.stages": ({0: ()}, ("stages",)),
}


def at_default(value: Any, default: Any) -> bool:
    """Whether a config field holds its default (a tuple field compared as a tuple: a
    recipe may write a list)."""
    return tuple(value) == tuple(default) if isinstance(default, tuple) else value == default


# A recipe's setting that a choice in another section cannot use: (the choice's field, whether
# its value rules the setting out, the setting, the value the setting goes back to, why).
RULED_OUT = (
    (
        "pipeline.stages",
        lambda stages: stages > 0,
        "model.scan_layers",
        False,
        "pipeline stages cut the model between blocks, which scanned layers stack into one",
    ),
)


def _unread_after_switches(config: ml_collections.ConfigDict) -> Iterator[tuple[str, str, Any]]:
    """``(switch, field, default)`` for each field of a switched section (:data:`SWITCHES`)
    that its choice does not read and that differs from its default."""
    defaults = base_config()
    for switch, (reads, always) in SWITCHES.items():
        section_name, _ = switch.split(".")
        if section_name not in config or config[switch] not in reads:
            continue  # an unknown choice is for its builder to name
        read = (*always, *reads[config[switch]])
        for field, value in config[section_name].items():
            default = defaults[section_name][field]
            if field not in read and not at_default(value, default):
                yield switch, f"{section_name}.{field}", default


def drop_unread_after_switch(config: ml_collections.ConfigDict, given: set[str]) -> list[str]:
    """Where ``given`` (the keys set on the command line) switches ``optimizer.name``,
    ``lr.kind`` or ``pipeline.stages``, the recipe's own settings that the new choice does
    not read go back to their defaults, and those it cannot use (:data:`RULED_OUT`: scanned
    layers under pipeline stages) go back to what it can; returns a note for each. A setting
    in ``given`` is kept, to be refused by :func:`refuse_unread` or the builder."""
    notes = []
    for switch, field, default in list(_unread_after_switches(config)):
        if switch in given and field not in given:
            value = config[field]
            section_name, leaf = field.split(".")
            config[section_name][leaf] = default
            notes.append(
                f"note: {field}={value!r} from the recipe does nothing with "
                f"{switch}={config[switch]!r}; dropped (back to its default {default!r})"
            )
    for choice, rules_out, setting, back, why in RULED_OUT:
        section_name, leaf = setting.split(".")
        if choice not in given or setting in given or leaf not in config.get(section_name, {}):
            continue
        value = config[setting]
        if rules_out(config[choice]) and value != back:
            config[section_name][leaf] = back
            notes.append(
                f"note: {setting}={value!r} from the recipe cannot be used with "
                f"{choice}={config[choice]!r} ({why}); dropped (back to {back!r})"
            )
    return notes


def refuse_unread(config: ml_collections.ConfigDict) -> None:
    """Refuse a field set away from its default that its section's switch does not read
    (``lr.power`` with a cosine schedule, ``optimizer.trust_coefficient`` with SGD, any
    pipeline field without stages): the run would silently ignore it."""
    for switch, field, default in _unread_after_switches(config):
        raise ValueError(
            f"{field}={config[field]!r} does nothing with {switch}={config[switch]!r}; leave "
            f"it at its default ({default!r}) or choose what reads it"
        )


def apply_overrides(
    config: ml_collections.ConfigDict, overrides: Iterable[str]
) -> ml_collections.ConfigDict:
    """Apply ``key=value`` strings (``--set`` arguments) to ``config`` in place and return it.

    ``key`` is a dotted path to an existing field; ``value`` is parsed as a Python literal
    (strings need no quotes, booleans may be written true/false) and must have the field's
    type. Derived fields that are ``FieldReference`` expressions follow their inputs. A switch
    (``optimizer.name``, ``lr.kind``) drops the recipe's settings the new choice does not read,
    with a note on stderr for each (:func:`drop_unread_after_switch`).
    """
    keys = flat_keys(config)
    given = set()
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        if key not in keys:
            near = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise ConfigError(f"unknown config key {key!r}{hint} (known keys: {', '.join(keys)})")
        given.add(key)
        *parents, leaf = key.split(".")
        node = config
        for name in parents:
            node = node[name]
        current = node[leaf]
        also_takes = STRING_CHOICES.get(key, ())
        if text in also_takes:
            node[leaf] = text
            continue
        if also_takes and isinstance(current, str):
            current = ()  # holds one of its words; its own type is a tuple
        value = _parse_value(text, current)
        if current is not None and isinstance(value, str) and not isinstance(current, str):
            raise ConfigError(
                f"--set {key}: expected {_a(type(current).__name__)} like {current!r}, got {text!r}"
            )
        try:
            node[leaf] = value
        except TypeError as err:
            # An unset field (None) of a declared type, such as optimizer.eps, names that type.
            expected = (
                f"{_a(node.get_type(leaf).__name__)} or None"
                if current is None
                else f"{_a(type(current).__name__)} like {current!r}"
            )
            raise ConfigError(
                f"--set {key}: expected {expected}, got {value!r} ({type(value).__name__})"
            ) from err
    for note in drop_unread_after_switch(config, given):
        print(note, file=sys.stderr)
    return config


def batch_stages(config: ml_collections.ConfigDict) -> tuple[tuple[float, int], ...]:
    """``(start_epoch, global_batch)`` stages from ``batch_ramp`` and ``batch_size``.

    ``batch_ramp = ((2, 128), (4, 256))`` with ``batch_size = 512`` means 128 images per step
    until epoch 2, 256 until epoch 4, then 512 (each pair is ``(until_epoch, batch)``).
    """
    stages, start = [], 0.0
    for index, pair in enumerate(config.batch_ramp):
        if len(pair) != 2:
            raise ConfigError(f"batch_ramp[{index}] must be (until_epoch, batch), got {pair!r}")
        until, batch = pair
        stages.append((start, int(batch)))
        start = until
    stages.append((start, int(config.batch_size)))
    return tuple(stages)


def base_config() -> ml_collections.ConfigDict:
    """Every field the trainer reads, with defaults (the module docstring says what each
    means); recipes start here."""
    c = ml_collections.ConfigDict()
    c.model = _model_fields()
    c.data = _data_fields()
    c.mesh = ""
    c.allreduce = "native"
    c.bucket_bytes = 16 * 2**20
    c.links = ""
    c.sfb_layers = ""
    c.unroll_limit = 16  # the schedules' own default, jaxdist.comm.collectives.UNROLL_LIMIT
    c.transfer_dtype = ""  # the dtype gradients travel in; "": each gradient's own
    c.sharding = "replicated"
    c.gather = ""  # the parameters' all-gather schedule under zero1/fsdp; "": allreduce's
    c.prefetch = 1  # layers ahead FSDP's gathers may start
    c.scatter_behind = False  # scanned layers' gradients reduce-scattered one layer later
    c.logical_axis_rules = ""  # name=axis,...; then heads, kv_heads and mlp over tensor
    c.tensor_schedule = "native"  # or collective_matmul
    c.tensor_sequence = False  # sequence parallelism between the tensor-parallel products
    c.wait_free = False
    c.batch_size = 256
    c.batch_ramp = ()
    c.max_per_device_batch = 256
    c.num_epochs = 90.0
    c.optimizer = ml_collections.ConfigDict(
        dict(
            name="sgd",
            momentum=0.9,
            nesterov=True,
            weight_decay=1e-4,
            trust_coefficient=0.001,
            # None: the chosen optimizer's own (optim.DEFAULT_EPS: adamw 1e-8, lars 0).
            eps=ml_collections.FieldReference(None, field_type=float),
            b1=0.9,
            b2=0.999,
            clip_norm=0.0,  # 0: no clipping
        )
    )
    c.lr = _lr_fields()
    c.label_smoothing = 0.0
    c.eval_every_epochs = 1.0
    c.eval_batch_size = 256
    c.checkpoint = ml_collections.ConfigDict(dict(every_steps=1000, keep=3, async_save=True))
    c.log_every_steps = 50
    c.seed = 0
    c.target_accuracy = 0.759
    c.max_steps = 0
    c.skip_nonfinite_steps = 0
    c.watchdog_s = 1800.0
    c.tensorboard = "auto"
    c.mlperf = ml_collections.ConfigDict(
        dict(
            org="jaxdist",
            platform="",
            division="closed",
            status="research",
            benchmark="",
            cache_cleared=False,
        )
    )
    c.pipeline = ml_collections.ConfigDict(
        dict(
            stages=0,
            microbatches=1,
            schedule="1f1b",
            chunks=1,
            # A tuple of first layers, or "auto" (the partitioner's cut).
            boundaries=ml_collections.FieldReference((), field_type=object),
            profile="",
        )
    )
    return c


def _model_fields() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        dict(
            name="resnet50",
            width=64,
            stem="imagenet",
            dtype="float32",
            zero_init_last_bn_scale=True,
            pointwise_matmul=True,
            bn_momentum=0.9,
            bn_epsilon=1e-5,
            bn_group_size=None,
        )
    )


def _data_fields() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        dict(
            source="synthetic",
            root="",
            dataset="",
            image_size=224,
            dtype="float32",
            seed=0,
            loader="grain",
            dali_threads=0,
            worker_count=0,
            read_threads=2,
            prefetch_batches=2,
            synthetic_train_examples=1_281_167,
            synthetic_eval_examples=50_000,
            num_classes=0,
            val_fraction=0.2,
            train_split="train",
            eval_split="val",
            image_key="",
            label_key="",
        )
    )


def _lr_fields() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        dict(
            kind="cosine",
            peak=0.1,
            warmup_epochs=5.0,
            end_lr=0.0,
            power=2.0,
            init_lr=0.0,
            step_epochs=(),
            step_factor=0.1,
        )
    )
