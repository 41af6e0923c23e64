"""Pipeline schedules as tables: every op once, dependencies kept, the bubble the papers give,
bounded live activations, and ``jaxdist pipeline show``."""

import itertools

import pytest

from jaxdist.cli import main
from jaxdist.pipeline.schedules import bubble_formula, build

CASES = [
    (name, stages, microbatches)
    for name, stages in itertools.product(("gpipe", "1f1b"), (2, 3, 4))
    for microbatches in (1, stages, 3 * stages)
] + [("interleaved", stages, m * stages) for stages in (2, 3, 4) for m in (1, 3)]


def placed(schedule):
    """{(kind, microbatch, virtual stage): tick} of every op in the table."""
    where = {}
    for tick, row in enumerate(schedule.table):
        assert len(row) == schedule.stages  # one op (or idle) per stage per tick
        for stage, op in enumerate(row):
            if op is not None:
                key = (op.kind, op.microbatch, op.chunk * schedule.stages + stage)
                assert key not in where, f"{key} runs twice"
                where[key] = tick
    return where


@pytest.mark.parametrize("name, stages, microbatches", CASES)
def test_every_op_runs_once_after_its_input(name, stages, microbatches):
    chunks = 2 if name == "interleaved" else 1
    schedule = build(name, stages, microbatches, chunks)
    where = placed(schedule)
    depth = stages * chunks
    expected = {(k, m, v) for k in "FB" for m in range(microbatches) for v in range(depth)}
    assert set(where) == expected
    for m in range(microbatches):
        for v in range(1, depth):
            assert where[("F", m, v)] > where[("F", m, v - 1)]
        for v in range(depth - 1):
            assert where[("B", m, v)] > where[("B", m, v + 1)]
        assert where[("B", m, depth - 1)] > where[("F", m, depth - 1)]


@pytest.mark.parametrize("name, stages, microbatches", CASES)
def test_bubble_is_the_papers_formula(name, stages, microbatches):
    chunks = 2 if name == "interleaved" else 1
    schedule = build(name, stages, microbatches, chunks)
    assert schedule.bubble_fraction == pytest.approx(
        bubble_formula(name, stages, microbatches, chunks), abs=1e-12
    )
    assert schedule.bubble_fraction == pytest.approx(
        (stages - 1) / (chunks * microbatches + stages - 1), abs=1e-12
    )


def test_1f1b_keeps_activations_bounded_by_the_stages_and_gpipe_by_the_microbatches():
    stages, microbatches = 4, 12
    assert build("gpipe", stages, microbatches).live_activations() == [12, 12, 12, 12]
    assert build("1f1b", stages, microbatches).live_activations() == [4, 3, 2, 1]
    interleaved = build("interleaved", stages, microbatches, 3)
    assert interleaved.bubble_fraction < build("1f1b", stages, microbatches).bubble_fraction
    assert max(interleaved.live_activations()) < 3 * microbatches


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("zigzag", 4, 8),
            "schedule must be one of gpipe, 1f1b, interleaved, pipedream, pipedream_2bw; got 'zigzag'",
        ),
        (("interleaved", 4, 6, 2), "microbatches (6) must be a multiple of stages (4)"),
        (("1f1b", 0, 8), "stages must be a positive integer, got 0"),
    ],
)
def test_bad_schedules_say_what_is_expected(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build(*args)


def test_pipeline_show_prints_the_table_and_draws_it(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    args = ["pipeline", "show", "--stages", "2", "--microbatches", "2", "--schedule", "1f1b"]
    assert main([*args, "--plot", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == [
        "1f1b: 2 stages, 2 micro-batches; 6 ticks",
        "stage 0: F0 F1  . B0  . B1",
        "stage 1:  . F0 B0 F1 B1  .",
    ]
    assert out[3] == "bubble: 0.3333 of stage-ticks idle (formula (S-1)/(v*M+S-1): 0.3333)"
    # Stage 1 keeps both inputs (F1 arrives before B0 runs); sends on ticks 0, 1 and 2, 4.
    assert out[5].startswith(
        "the step's program: 2 stashed inputs per device, 4 permutes per "
        "step (2 forward, 2 backward"
    )
    assert png.stat().st_size > 0
    assert (
        main(
            [
                "pipeline",
                "show",
                "--stages",
                "4",
                "--microbatches",
                "6",
                "--schedule",
                "interleaved",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == (
        "jaxdist pipeline: the interleaved schedule runs micro-batches in groups of the stage "
        "count: microbatches (6) must be a multiple of stages (4)"
    )
