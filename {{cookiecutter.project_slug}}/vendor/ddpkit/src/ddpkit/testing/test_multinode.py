"""Multi-node launchers on one machine: two torchrun "nodes", a SLURM job, and SLURM's requeue signal."""

import os
import re
import signal

import pytest
import torch
from fake_cluster import (
    base_env,
    finish,
    free_port,
    kill_group,
    last_weights,
    slurm_env,
    start,
    wait_for,
)

from ddpkit.parity import max_abs
from ddpkit.requeue import next_hpc_checkpoint

# float64 and 2 epochs (32 steps, across an epoch boundary): equal weights up to float64 rounding.
TRAIN = ["--trainer.accelerator", "cpu", "--trainer.precision", "64-true", "--trainer.max_epochs", "2"]
TRAIN += ["--trainer.enable_progress_bar", "false", "--trainer.callbacks+=rank_probe.RankProbe"]
TRAIN += ["--trainer.callbacks+=parity_probe.NoDropout"]  # as in the reference run (parity_probe.Probe)


@pytest.fixture(scope="module")
def reference(cpu_runs, global_batch):
    """Weights after the same training on 1 device (the parity tests' float64 run, tests/runs.py)."""
    return last_weights(cpu_runs["1dev-fp64"].root, 2 * global_batch["steps_per_epoch"])


def probes(text: str) -> list[str]:
    return sorted(re.findall(r"RANK_PROBE .*", text))


def test_two_torchrun_nodes_train_the_same_weights_as_one_device(reference, global_batch, tmp_path):
    """cluster/torchrun.sh as 2 agents x 1 process (c10d rendezvous on localhost) matches 1 device."""
    port = free_port()
    env = base_env(NNODES="2", GPUS_PER_NODE="1", RDZV_ENDPOINT=f"localhost:{port}", RDZV_ID=f"test{port}")
    cmd = ["bash", "cluster/torchrun.sh", *TRAIN, "--trainer.default_root_dir", str(tmp_path)]
    agents = [start(cmd, env, tmp_path / f"agent{i}.log") for i in range(2)]
    codes = finish(agents, timeout=300)
    logs = "".join((tmp_path / f"agent{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], logs[-4000:]
    assert probes(logs) == [
        f"RANK_PROBE global={r} local=0 node={r} world=2 env=TorchElasticEnvironment step=0" for r in range(2)
    ]
    assert max_abs(last_weights(tmp_path, 2 * global_batch["steps_per_epoch"]), reference) < 1e-12


def test_slurm_job_of_two_nodes_trains_the_same_weights_as_one_device(reference, global_batch, tmp_path):
    """cluster/slurm.sbatch under a 2-node SLURM job's variables: Lightning takes ranks from SLURM, matches 1 device."""
    env = slurm_env(tmp_path, nodes=2, tasks_per_node=1, job_id=4242)
    job = start(
        ["bash", "cluster/slurm.sbatch", *TRAIN, "--trainer.default_root_dir", str(tmp_path)], env, tmp_path / "job.log"
    )
    codes = finish([job], timeout=300)
    tasks = [(tmp_path / "tasks" / f"task{r}.out").read_text() for r in range(2)]
    assert codes == [0], (tmp_path / "job.log").read_text() + tasks[0][-3000:] + tasks[1][-3000:]
    for rank, out in enumerate(tasks):
        assert probes(out) == [f"RANK_PROBE global={rank} local=0 node={rank} world=2 env=SLURMEnvironment step=0"]
    assert max_abs(last_weights(tmp_path, 2 * global_batch["steps_per_epoch"]), reference) < 1e-12


OWN_CALLBACKS = """
trainer:
  callbacks:
    - class_path: ddpkit.checkpoints.CurrentModelCheckpoint
      init_args:
        monitor: null
        save_last: true
"""


def test_requeue_signal_saves_a_checkpoint_and_the_requeued_job_resumes_from_it(global_batch, tmp_path):
    """SIGUSR1 (SLURM, before the time limit): hpc_ckpt_1.ckpt and `scontrol requeue`; the rerun resumes from it."""
    env = slurm_env(tmp_path, nodes=1, tasks_per_node=2, job_id=4243)
    root, tasks = tmp_path / "root", tmp_path / "tasks"
    # A config with its own callbacks list, as configs/lm.yaml has: it must not drop the requeue callback.
    (tmp_path / "callbacks.yaml").write_text(OWN_CALLBACKS)
    args = ["--config", str(tmp_path / "callbacks.yaml")]
    args += ["--trainer.accelerator", "cpu", "--trainer.max_epochs", "3", "--trainer.enable_progress_bar", "false"]
    args += ["--trainer.default_root_dir", str(root), "--trainer.callbacks+=rank_probe.RankProbe"]
    # Slow steps keep the first job running until the test has signalled it; the requeued run is not slowed.
    job = start(
        ["bash", "cluster/slurm.sbatch", *args, "--trainer.callbacks.sleep_per_step", "0.05"],
        env,
        tmp_path / "job1.log",
    )
    try:
        # Signal in the second epoch, once the first epoch's checkpoint is written.
        wait_for(lambda: any(root.glob("lightning_logs/*/checkpoints/last.ckpt")), timeout=240, what="epoch 1")
        os.kill(int((tasks / "srun.pid").read_text()), signal.SIGUSR1)  # what --signal=SIGUSR1@90 does
        codes = finish([job], timeout=120)
    finally:
        kill_group(job)
    first = [(tasks / f"task{r}.out").read_text() for r in range(2)]
    assert codes == [0], first[0][-3000:] + first[1][-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4243\n"
    hpc = root / "hpc_ckpt_1.ckpt"
    saved_step = torch.load(hpc, weights_only=True)["global_step"]
    steps = global_batch["steps_per_epoch"]
    assert steps < saved_step < 3 * steps and f"saved {hpc} at step {saved_step}" in first[0]

    requeued = start(["bash", "cluster/slurm.sbatch", *args], env, tmp_path / "job2.log")
    codes = finish([requeued], timeout=300)
    second = [(tasks / f"task{r}.out").read_text() for r in range(2)]
    assert codes == [0], second[0][-3000:] + second[1][-3000:]
    assert f"Restoring states from the checkpoint path at {hpc}" in second[0]
    for rank, out in enumerate(second):
        assert probes(out) == [
            f"RANK_PROBE global={rank} local={rank} node=0 world=2 env=SLURMEnvironment step={saved_step}"
        ]
    for rank, out in enumerate(second):
        assert f"RANK_PROBE_END global={rank} step={3 * steps}" in out  # 3 epochs


def test_next_hpc_checkpoint_follows_the_highest_number(tmp_path):
    """Lightning resumes from the highest hpc_ckpt_N.ckpt, so a new save takes N + 1 (1 in an empty dir)."""
    assert next_hpc_checkpoint(tmp_path) == tmp_path / "hpc_ckpt_1.ckpt"
    for name in ("hpc_ckpt_2.ckpt", "hpc_ckpt_10.ckpt", "hpc_ckpt_x.ckpt"):
        (tmp_path / name).touch()
    assert next_hpc_checkpoint(tmp_path) == tmp_path / "hpc_ckpt_11.ckpt"
