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
    """docs/api.md as the modules define it: per package, each module that exports names,
    its summary line and its ``__all__``."""
    lines = [
        "# API reference",
        "",
        "The modules of `jaxdist` that export names (their `__all__`), by package: what research",
        "code should use, each under its one name (`from jaxdist.comm import collectives`).",
        "Everything else (the command line, the modules not listed) is internal and may change.",
        "Generated from the code by `python tests/test_public_api.py`; a test keeps the two in",
        "step.",
    ]
    modules = {name: importlib.import_module(name) for name in library_modules()}
    package = None
    for name, module in modules.items():
        if name == "jaxdist" or not module.__all__:
            continue  # a module that exports nothing is internal
        top = ".".join(name.split(".")[:2])
        if top != package:
            package = top
            summary = _markdown(_summary(modules[top]))
            lines += ["", f"## `{top}`", "", summary, ""]
        exported = ", ".join(f"`{n}`" for n in module.__all__)
        lines.append(f"- `{name}`: {_markdown(_summary(module))} {exported}")
    return "\n".join(lines) + "\n"


def _summary(module) -> str:
    """A module docstring's first paragraph on one line."""
    return (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")


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


def test_modules_have_one_name_and_import_jaxdist_imports_nothing_else():
    """No import hook and no second names: ``jaxdist.collectives`` is not a module, and
    ``import jaxdist`` leaves JAX unimported."""
    code = (
        "import sys, jaxdist\n"
        "assert 'jax' not in sys.modules, 'import jaxdist imported jax'\n"
        "assert not any(type(f).__module__.startswith('jaxdist') for f in sys.meta_path)\n"
        "try:\n"
        "    import jaxdist.collectives\n"
        "except ModuleNotFoundError as err:\n"
        "    assert err.name == 'jaxdist.collectives'\n"
        "else:\n"
        "    raise AssertionError('a second name imported')\n"
        "from jaxdist.comm import collectives\n"
        "assert collectives.__name__ == 'jaxdist.comm.collectives'\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_install_pulls_only_what_training_needs():
    """No package that only a plot, a checker or a bundled dataset would need is a hard
    dependency, and every third-party package jaxdist imports at module level is declared."""
    import ast
    import sys
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    names = {
        d.split(">")[0].split("[")[0].split("=")[0].strip().lower() for d in project["dependencies"]
    }
    assert not names & {
        "mlxtend",
        "scikit-learn",
        "pandas",
        "scipy",
        "matplotlib",
        "mlperf-logging",
    }, names
    distribution = {
        "absl": "absl-py",
        "ml_collections": "ml-collections",
        "array_record": "array-record",
        "orbax": "orbax-checkpoint",
        "PIL": "pillow",
        "cv2": "opencv-python-headless",
    }
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


if __name__ == "__main__":
    API_DOC.write_text(api_reference())
    print(f"wrote {API_DOC}")
