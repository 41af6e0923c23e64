"""benchmarks/lowered_programs.py: the check that a refactor leaves every schedule's lowered
program unchanged must itself notice a change."""

from __future__ import annotations

import importlib.util

import pytest

from tests._procs import REPO


def _tool():
    spec = importlib.util.spec_from_file_location(
        "lowered_programs", REPO / "benchmarks" / "lowered_programs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # lowers every schedule's 300+ programs twice (about 50 s)
def test_lowering_is_repeatable_and_a_changed_program_is_named(tmp_path, capsys):
    tool = _tool()
    before, after = tmp_path / "before", tmp_path / "after"
    written = tool.write(before)
    assert written == len(list(before.glob("*.mlir"))) > 300
    tool.write(after)
    assert tool.compare(before, after) == 0
    # Every form but psum's is made of collective permutes.
    programs = {p.name: p.read_text() for p in before.glob("*.mlir")}
    without = sorted(n for n, text in programs.items() if "collective_permute" not in text)
    assert without and all(n.startswith("native_") for n in without), without
    changed = after / "ring_ring8_65536.mlir"
    changed.write_text(changed.read_text().replace("collective_permute", "all_reduce", 1))
    (after / "torus2d_4x2_5.mlir").unlink()
    capsys.readouterr()
    assert tool.compare(before, after) == 2
    out = capsys.readouterr().out
    assert "differs: ring_ring8_65536.mlir" in out
    assert "only in before: torus2d_4x2_5.mlir" in out
