"""Batch-size control: step -> batch size, samples seen, epoch; stage boundaries; device plans."""

from fractions import Fraction

import pytest

from jaxdist.training.batch_schedule import BatchSchedule, DevicePlan, Stage, per_device_plan

# 1,000 samples; 128 per step for epoch [0, 1), 256 for [1, 2.5), 512 afterwards.
# Stage 1 starts at step 8 (8 * 128 = 1,024 >= 1,000 samples: 24 samples of overshoot);
# stage 2 at step 14 (1,024 + 6 * 256 = 2,560 >= 2,500).
RAMP = BatchSchedule(((0, 128), (1, 256), (2.5, 512)), dataset_size=1000)


@pytest.mark.parametrize(
    "step, batch_size, samples_seen, epoch",
    [
        (0, 128, 0, 0.0),
        (1, 128, 128, 0.128),
        (7, 128, 896, 0.896),
        (8, 256, 1024, 1.024),
        (9, 256, 1280, 1.28),
        (13, 256, 2304, 2.304),
        (14, 512, 2560, 2.56),
        (15, 512, 3072, 3.072),
        (20, 512, 5632, 5.632),
    ],
)
def test_ramp_table(step, batch_size, samples_seen, epoch):
    assert RAMP.batch_size_at(step) == batch_size
    assert RAMP.samples_seen(step) == samples_seen
    assert RAMP.epoch_at(step) == pytest.approx(epoch)


def test_stage_boundaries():
    assert RAMP.stage_start_steps == (0, 8, 14)
    assert RAMP.stage_start_samples == (0, 1024, 2560)
    assert RAMP.stage_boundaries() == [
        (0, Stage(0, 128)),
        (8, Stage(1, 256)),
        (14, Stage(2.5, 512)),
    ]
    assert [RAMP.stage_index_at(s) for s in (0, 7, 8, 13, 14, 1000)] == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize(
    "epochs, steps",
    [
        (0, 0),
        (0.5, 4),  # 4 * 128 = 512 >= 500
        (1, 8),
        (2.4, 14),  # 13 steps give 2,304 < 2,400
        (2.5, 14),
        (3, 15),
        (5, 19),  # 2,560 + 5 * 512 = 5,120 >= 5,000; 4 more steps would give 4,608
    ],
)
def test_steps_for_epochs(epochs, steps):
    assert RAMP.steps_for_epochs(epochs) == steps
    assert RAMP.samples_seen(steps) >= epochs * RAMP.dataset_size
    if steps:
        assert RAMP.samples_seen(steps - 1) < epochs * RAMP.dataset_size


def test_stage_starting_exactly_on_a_step_has_no_overshoot():
    schedule = BatchSchedule(((0, 256), (2, 512)), dataset_size=1024)
    assert schedule.stage_start_steps == (0, 8)
    assert schedule.epoch_at(8) == 2.0
    assert schedule.steps_for_epochs(4) == 12


def test_epochs_are_exact_decimals():
    # 0.7 * 10 == 7.000000000000001 in floats; ceil of that would start the stage a step late.
    schedule = BatchSchedule(((0, 1), (0.7, 2)), dataset_size=10)
    assert schedule.stage_start_steps == (0, 7)
    assert schedule.steps_for_epochs(0.7) == 7
    fraction = BatchSchedule(((0, 1), (Fraction(1, 3), 2)), dataset_size=9)
    assert fraction.stage_start_steps == (0, 3)


def test_constant_schedule():
    schedule = BatchSchedule.constant(100, dataset_size=1000)
    assert [schedule.batch_size_at(s) for s in (0, 9, 10, 1000)] == [100] * 4
    assert schedule.steps_for_epochs(90) == 900
    assert schedule.epoch_at(25) == 2.5


def test_table_lists_stage_starts_and_the_end():
    rows = RAMP.table(epochs=3)
    assert [(r["step"], r["batch_size"], r["samples_seen"]) for r in rows] == [
        (0, 128, 0),
        (8, 256, 1024),
        (14, 512, 2560),
        (15, 512, 3072),
    ]


def test_schedule_is_frozen_and_hashable():
    with pytest.raises(AttributeError):
        RAMP.dataset_size = 5  # type: ignore[misc]
    same = BatchSchedule([(0, 128), [1, 256], Stage(2.5, 512)], dataset_size=1000)
    assert same == RAMP and hash(same) == hash(RAMP)


@pytest.mark.parametrize(
    "stages, dataset_size, message",
    [
        ((), 1000, "at least one stage"),
        (((1, 128),), 1000, "first stage must start at epoch 0, got start_epoch=1"),
        (
            ((0, 128), (2, 256), (2, 512)),
            1000,
            "stage 2 starts at epoch 2, after stage 1 at epoch 2",
        ),
        (((0, 128), (3, 256), (2, 512)), 1000, "must strictly increase"),
        (((0, 0),), 1000, r"stage 0: global_batch_size must be a positive integer, got 0"),
        (((0, 128.0),), 1000, r"global_batch_size must be a positive integer, got 128.0"),
        (((0, 128), (-1, 256)), 1000, r"stage 1: start_epoch must be a finite number >= 0, got -1"),
        (((0, 128), (float("nan"), 256)), 1000, "start_epoch must be a finite number"),
        (((0, 128, 5),), 1000, r"stage 0 must be a pair \(start_epoch, global_batch_size\)"),
        (((0, 128),), 0, "dataset_size must be a positive integer, got 0"),
        # 64 samples after one step overshoot stage 2's start at 60 samples: stage 1 is empty.
        (((0, 64), (0.5, 32), (0.6, 16)), 100, "stage 1 .* gets no steps"),
    ],
)
def test_bad_schedules_are_rejected(stages, dataset_size, message):
    with pytest.raises(ValueError, match=message):
        BatchSchedule(stages, dataset_size=dataset_size)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: RAMP.batch_size_at(-1), "step must be a non-negative integer, got -1"),
        (lambda: RAMP.samples_seen(2.0), "num_steps must be a non-negative integer, got 2.0"),
        (lambda: RAMP.steps_for_epochs(-0.5), "epochs must be a finite number >= 0"),
    ],
)
def test_bad_queries_are_rejected(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --------------------------------------------------------------------------- device plans


@pytest.mark.parametrize(
    "global_batch, devices, max_per_device, per_device, accumulation",
    [
        (1024, 8, 128, 128, 1),  # fits: one step, no accumulation
        (1024, 8, 1000, 128, 1),
        (1024, 8, 100, 64, 2),  # 128 per device does not fit; 2 micro-steps of 64
        (1024, 8, 48, 32, 4),  # 3 does not divide 128, so 4 micro-steps of 32
        (96, 8, 5, 4, 3),
        (56, 8, 3, 1, 7),  # 7 per device is prime: micro-batches of 1
        (34_816, 2176, 16, 16, 1),  # Mikami v1: 34K on 2,176 GPUs
        (69_632, 2176, 16, 16, 2),  # ... 68K after the ramp, same per-GPU memory
    ],
)
def test_per_device_plan(global_batch, devices, max_per_device, per_device, accumulation):
    plan = per_device_plan(global_batch, devices, max_per_device)
    assert plan == DevicePlan(global_batch, devices, per_device, accumulation)
    assert plan.micro_batch_size * plan.accumulation_steps == global_batch


@pytest.mark.parametrize(
    "args, message",
    [
        ((1000, 16, 64), r"global batch 1000 does not divide over 16 devices \(remainder 8\)"),
        ((1024, 0, 64), "num_devices must be a positive integer, got 0"),
        ((1024, 8, 0), "max_per_device_batch must be a positive integer, got 0"),
    ],
)
def test_per_device_plan_errors(args, message):
    with pytest.raises(ValueError, match=message):
        per_device_plan(*args)


def test_device_plans_for_every_stage():
    plans = RAMP.device_plans(num_devices=8, max_per_device_batch=32)
    assert [(p.per_device_batch, p.accumulation_steps) for p in plans] == [
        (16, 1),
        (32, 1),
        (32, 2),
    ]
    with pytest.raises(ValueError, match="global batch 128 does not divide over 48 devices"):
        RAMP.device_plans(num_devices=48, max_per_device_batch=32)
