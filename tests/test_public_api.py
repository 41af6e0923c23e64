"""The public API: every module declares ``__all__``, its names exist, the short names work
lazily, and ``docs/api.md`` lists exactly those names.

``python tests/test_public_api.py`` rewrites docs/api.md from the modules.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jaxdist

ROOT = Path(__file__).resolve().parents[1]
API_DOC = ROOT / "docs" / "api.md"


def library_modules() -> list[str]:
    """Every module of the package except the ``python -m jaxdist`` entry point."""
    names = ["jaxdist"]
    for info in pkgutil.walk_packages(jaxdist.__path__, "jaxdist."):
        if not info.name.endswith("__main__"):
            names.append(info.name)
    return sorted(names)


def api_reference() -> str:
    """docs/api.md as the modules define it: per module its summary line and ``__all__``."""
    lines = [
        "# API reference",
        "",
        "Every module of `jaxdist` that exports names (its `__all__`): what research code",
        "should use. Everything else, including the modules not listed (the command line and",
        "building blocks of the package's own modules), is internal and may change. The short names",
        "`jaxdist.collectives`, `jaxdist.meshes`, `jaxdist.train_step`, ... resolve to the modules",
        "below (`import jaxdist; jaxdist.collectives.allreduce`). This page is generated from the",
        "code by `python tests/test_public_api.py`, and a test keeps the two in step.",
        "",
    ]
    modules = {name: importlib.import_module(name) for name in library_modules()}
    exporting = [name for name, module in modules.items() if module.__all__]
    for name, module in modules.items():
        # A package is listed for the modules under it that export names; a module that
        # exports nothing is internal.
        if name == "jaxdist" or not (
            name in exporting or any(e.startswith(name + ".") for e in exporting)
        ):
            continue
        summary = _markdown((module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "))
        exported = ", ".join(f"`{n}`" for n in module.__all__) or "(none: see its submodules)"
        lines += [f"## `{name}`", "", summary, "", exported, ""]
    return "\n".join(lines)


def _markdown(rst: str) -> str:
    """A docstring's reST roles and double backticks as markdown code spans."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", rst)
    return text.replace("``", "`")


@pytest.mark.parametrize("name", library_modules())
def test_every_module_declares_what_it_exports(name):
    module = importlib.import_module(name)
    assert hasattr(module, "__all__"), f"{name} has no __all__"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names {missing}, which the module does not define"
    assert len(set(module.__all__)) == len(module.__all__), f"{name}.__all__ repeats a name"


def test_api_doc_lists_exactly_the_exported_names():
    expected = api_reference()
    found = API_DOC.read_text()
    assert found == expected, (
        "docs/api.md does not match the modules' __all__: run `python tests/test_public_api.py`"
    )


def test_short_names_resolve_lazily_to_the_modules():
    code = (
        "import sys, jaxdist\n"
        "assert 'jax' not in sys.modules, 'import jaxdist imported jax'\n"
        "from jaxdist import collectives, meshes, train_step as ts\n"
        "import jaxdist.comm.collectives as canonical\n"
        "assert jaxdist.collectives is canonical\n"
        "assert jaxdist.collectives.allreduce is canonical.allreduce\n"
        "assert ts.TrainStep.__module__ == 'jaxdist.training.train_step'\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_short_name_imports_in_every_form():
    """``import jaxdist.X`` and ``from jaxdist.X import name`` reach the same module as
    ``jaxdist.X``, for every short name the package documents."""
    code = (
        "import importlib, sys, jaxdist\n"
        "for short, real in jaxdist._MODULES.items():\n"
        "    module = importlib.import_module('jaxdist.' + short)\n"
        "    assert module is importlib.import_module(real), short\n"
        "    assert getattr(jaxdist, short) is module, short\n"
        "import jaxdist.distributed\n"
        "from jaxdist.config import load_recipe\n"
        "from jaxdist.trainer import Trainer\n"
        "assert Trainer.__module__ == 'jaxdist.run.trainer'\n"
        "assert load_recipe.__module__ == 'jaxdist.run.config'\n"
        "assert jaxdist.distributed.initialize.__module__ == 'jaxdist.runtime.distributed'\n"
        "try:\n"
        "    import jaxdist.colectives\n"
        "except ModuleNotFoundError as err:\n"
        "    assert err.name == 'jaxdist.colectives'\n"
        "else:\n"
        "    raise AssertionError('a misspelt short name imported')\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_short_name_imports_as_the_module_it_stands_for():
    from jaxdist.checkpoint import Checkpointer

    short = importlib.import_module("jaxdist.checkpoint")
    assert short is importlib.import_module("jaxdist.run.checkpoint") is jaxdist.checkpoint
    assert Checkpointer is short.Checkpointer
    with pytest.raises(ModuleNotFoundError, match=r"jaxdist\.colectives"):
        importlib.import_module("jaxdist.colectives")


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'colectives'"):
        jaxdist.colectives  # noqa: B018


if __name__ == "__main__":
    API_DOC.write_text(api_reference())
    print(f"wrote {API_DOC}")


def test_the_install_pulls_only_what_training_needs():
    """No package that only a plot, a checker or a bundled dataset would need is a hard
    dependency, and every third-party package jaxdist imports at module level is declared."""
    import ast
    import sys
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("[")[0].split("=")[0].strip().lower()
             for d in project["dependencies"]}  # fmt: skip
    assert not names & {"mlxtend", "scikit-learn", "pandas", "scipy", "matplotlib",
                        "mlperf-logging"}, names  # fmt: skip
    distribution = {"absl": "absl-py", "ml_collections": "ml-collections",
                    "array_record": "array-record", "orbax": "orbax-checkpoint",
                    "PIL": "pillow"}  # fmt: skip
    imported = set()
    for path in (root / "jaxdist").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level: what every import needs
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "jaxdist"}
    undeclared = {m for m in third_party if distribution.get(m, m).replace("_", "-") not in names}
    assert undeclared == set(), undeclared
