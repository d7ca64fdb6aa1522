"""The scaling doctor's numbers on the configured model (config.yaml: yours, once you point it at your model)
against the same work timed alone: its data part against the training loader iterated alone
(tests/loader_alone.py), its all-reduce part against an all-reduce of the model's gradient size alone
(tests/allreduce_alone.py). The tests' sleeping model gets the same checks in test_scaling_gap.py."""

import json

import pytest
from alone import THREADS, TOLERANCE, allreduce_ms, loader_ms
from helpers import run_ok

from ddpkit.gap import components

STEPS = 60  # 3 warm-up + 57 timed: a few epochs of the example, long enough to average 2 cores' jitter


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, configured) -> dict:
    """The doctor's summary of a 2-rank CPU fit of the configured model, with its all-reduce timed."""
    root = tmp_path_factory.mktemp("doctor-numbers")
    args = ["fit", "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--doctor.measure_comm", "true"]
    args += ["--trainer.max_steps", str(STEPS), "--trainer.default_root_dir", str(root)]
    if configured["takes_micro_batch_size"]:
        args += ["--data.micro_batch_size", "null"]  # one all-reduce per batch, as the alone run does
    run_ok(*args, cwd=root, timeout=600, env=THREADS)
    return json.loads(next(root.rglob("doctor.json")).read_text())


def test_comm_part_matches_the_allreduce_alone(two_ranks):
    """The all-reduce part of the step (as the gap counts it: the last rank's, without its threads' wait for
    a CPU) is an all-reduce of the model's gradient size timed alone, within TOLERANCE."""
    mb = two_ranks["grad_mb"]
    alone = allreduce_ms([mb])[mb]
    in_step = components(two_ranks)["comm"]
    print(f"{mb:.3g} MB: in the step {in_step:.2f} ms, alone {alone:.2f} ms")
    assert abs(in_step - alone) <= TOLERANCE["comm"](alone)


def test_data_part_matches_the_loader_alone(two_ranks):
    """Each rank's data wait (without its wait for a CPU) is its loader's time per batch iterated alone,
    within TOLERANCE; with loader workers, which load ahead while the step computes, at most that."""
    alone = loader_ms(devices=2)
    for rank in two_ranks["ranks"]:
        in_step = rank["data_ms"] - rank.get("data_contention_ms", 0.0)
        print(f"rank {rank['rank']}: data in the step {in_step:.2f} ms, loader alone {alone:.2f} ms")
        if two_ranks["num_workers"]:
            assert in_step <= alone + TOLERANCE["data"](alone)
        else:
            assert abs(in_step - alone) <= TOLERANCE["data"](alone)
