"""Multi-node launchers on one machine: two torchrun "nodes", a SLURM job, and SLURM's requeue signal.

Each job runs the project's own launch script (cluster/torchrun.sh, cluster/slurm.sbatch) with the first
wave's float64 training (commands.cluster_args) and must end with the 1-device run's weights. The SLURM job is
signalled to requeue in its second epoch and then requeued, as SLURM would (fake_cluster.slurm_requeue_job).
"""

import re

import torch

from ..parity import ROUNDING_FACTOR, max_abs
from .bounds import Bound, assert_within, fp64_bound, no_gradient, run_to_run
from .fake_cluster import SLURM_JOB_ID, last_weights
from .runs import comparable, reads, total_steps


def probes(text: str) -> list[str]:
    return sorted(re.findall(r"RANK_PROBE .*", text))


def reference(cpu_runs, global_batch, devices: int = 1) -> dict[str, torch.Tensor]:
    """Weights after the same training on 1 (or 2) devices under Lightning's launcher (the first wave's float64
    runs)."""
    comparable(global_batch)
    return last_weights(cpu_runs[f"{devices}dev-fp64"].root, total_steps(global_batch))


def assert_same_weights(weights: dict[str, torch.Tensor], cpu_runs, global_batch, steps, name: str) -> None:
    """1 device's weights within the float64 bound the model's own rounding sets (bounds.fp64_bound), and 2
    devices' under Lightning's launcher bit for bit: the same 2 ranks sum the same gradients in the same order,
    whichever launcher started them (both jobs measured 0.0 from it, and 2.1e-16 from 1 device: digits,
    2026-12-02, docs/measurements.md). Where two identical 2-device runs are not bit-identical, within
    ROUNDING_FACTOR x how far apart they end (bounds.run_to_run)."""
    assert_within(reference(cpu_runs, global_batch), weights, fp64_bound(cpu_runs, steps), f"{name} vs 1dev")
    two = reference(cpu_runs, global_batch, devices=2)
    if max_abs(weights, two) != 0.0:
        noise = run_to_run(cpu_runs, no_gradient(cpu_runs))
        own = {n: ROUNDING_FACTOR * v for n, v in noise.per_tensor.items()}
        bound = Bound(0.0, why=f"{ROUNDING_FACTOR:g} x run to run: {noise.why}", own=own)
        assert_within(two, weights, bound, f"{name} vs 2dev (bit-identical expected unless identical runs differ)")


@reads("torchrun-nodes", "1dev-fp64", "2dev-fp64", "{bound}")
def test_two_torchrun_nodes_train_the_same_weights_as_one_device(cpu_runs, global_batch, steps):
    """cluster/torchrun.sh as 2 agents x 1 process (c10d rendezvous on localhost) matches 1 device, and 2
    devices bit for bit."""
    job = cpu_runs["torchrun-nodes"]
    logs = "".join(job.outputs)
    assert job.codes == [0, 0], logs[-4000:]
    assert probes(logs) == [
        f"RANK_PROBE global={r} local=0 node={r} world=2 env=TorchElasticEnvironment step=0" for r in range(2)
    ]
    assert_same_weights(
        last_weights(job.root, total_steps(global_batch)), cpu_runs, global_batch, steps, "torchrun nodes"
    )


@reads("slurm-requeue", "1dev-fp64", "2dev-fp64", "{bound}")
def test_slurm_job_of_two_nodes_trains_the_same_weights_as_one_device(cpu_runs, global_batch, steps):
    """cluster/slurm.sbatch under a 2-node SLURM job's variables: Lightning takes ranks from SLURM in the job and
    in its requeued run, and the requeued run, resumed mid-epoch, ends with 1 device's weights."""
    job = cpu_runs["slurm-requeue"]
    assert job.codes == [0, 0], job.first[0][-3000:] + job.first[1][-3000:] + job.second[0][-3000:]
    for rank in range(2):
        for out in (job.first[rank], job.second[rank]):
            (probe,) = probes(out)
            assert probe.startswith(f"RANK_PROBE global={rank} local=0 node={rank} world=2 env=SLURMEnvironment ")
    assert_same_weights(last_weights(job.root, total_steps(global_batch)), cpu_runs, global_batch, steps, "SLURM job")


@reads("slurm-requeue")
def test_requeue_signal_saves_a_checkpoint_and_the_requeued_job_resumes_from_it(cpu_runs, global_batch):
    """SIGUSR1 (SLURM, before the time limit): hpc_ckpt_1.ckpt and `scontrol requeue`; the rerun resumes from it
    and finishes the run (the project's config.yaml lists its own callbacks, and the requeue callback stays)."""
    job = cpu_runs["slurm-requeue"]
    assert job.codes == [0, 0], job.first[0][-3000:] + job.second[0][-3000:]
    assert job.scontrol == f"requeue {SLURM_JOB_ID}\n"
    hpc = job.root / "hpc_ckpt_1.ckpt"
    saved_step = torch.load(hpc, weights_only=True)["global_step"]
    # Mid-run: the signal comes once the first last.ckpt is written, at epoch 0's end (or at its first validation
    # with `val_check_interval` under 1).
    assert 0 < saved_step < total_steps(global_batch) and f"saved {hpc} at step {saved_step}" in job.first[0]
    assert f"Restoring states from the checkpoint path at {hpc}" in job.second[0]
    for rank, out in enumerate(job.second):
        assert probes(out) == [
            f"RANK_PROBE global={rank} local=0 node={rank} world=2 env=SLURMEnvironment step={saved_step}"
        ]
        assert f"RANK_PROBE_END global={rank} step={total_steps(global_batch)}" in out  # 2 epochs
