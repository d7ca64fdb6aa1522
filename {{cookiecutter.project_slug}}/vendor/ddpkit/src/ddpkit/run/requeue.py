"""Save and requeue a SLURM job before its time limit, with every rank saving at the same step.

SLURM sends SIGUSR1 (`#SBATCH --signal=SIGUSR1@90`) to every task shortly before
the time limit. Lightning's own handler saves the checkpoint *inside* the signal
handler, wherever each rank happens to be, and the save ends with a barrier that
another rank may meet inside a different collective: in one of two tries here, 2
CPU ranks hung after rank 0 had written the file. This callback only notes the signal; at the next step boundary the
ranks agree (one all-reduce), all save `hpc_ckpt_N.ckpt` together, rank 0 runs
`scontrol requeue`, and training stops. The requeued job runs the same command
and Lightning restores the newest `hpc_ckpt_N.ckpt` in `default_root_dir` by
itself (no `--ckpt_path`). Outside SLURM it does nothing.
"""

import os
import re
import signal
import subprocess
from pathlib import Path

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn


def next_hpc_checkpoint(root: str | os.PathLike) -> Path:
    """`hpc_ckpt_<N+1>.ckpt` in `root`: the name Lightning looks for (highest N) when a SLURM job restarts."""
    names = (re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", p.name) for p in Path(root).glob("hpc_ckpt_*"))
    numbers = [int(m.group(1)) for m in names if m]
    return Path(root) / f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt"


class SlurmRequeue(L.Callback):
    """On SLURM's requeue signal: save a checkpoint on all ranks at one step, requeue the job, stop.

    Args:
        signal_name: The signal SLURM sends before the time limit (`#SBATCH --signal=<name>@<seconds>`).
        check_every_n_steps: How often the ranks compare notes (one blocking all-reduce of one number,
            on GPUs also a host-device sync, so not every step). The signal comes 90 s early, so a few
            steps' delay costs nothing.
    """

    def __init__(self, signal_name: str = "SIGUSR1", check_every_n_steps: int = 10) -> None:
        self.signum = signal.Signals[signal_name]
        self.check_every_n_steps = check_every_n_steps
        self.requested = False
        self.active = False
        self.step = 0  # global_step at the last batch's end

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Replaces the handler Lightning registered just before this hook; Lightning restores the
        # original handlers when fit ends.
        self.active = isinstance(trainer.strategy.cluster_environment, SLURMEnvironment)
        self.step = trainer.global_step
        if self.active:
            signal.signal(self.signum, self._note_signal)

    def _note_signal(self, signum, frame) -> None:
        self.requested = True  # nothing else here: the handler may run in the middle of a collective

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        # Only where an optimizer step ended: a checkpoint saved between the micro-batches of a step (gradient
        # accumulation) holds no gradients, and the resumed job would step on the step's remaining batches alone.
        stepped, self.step = trainer.global_step != self.step, trainer.global_step
        if not self.active or not stepped or trainer.global_step % self.check_every_n_steps:
            return
        # Any rank that got the signal stops all of them, at this same step.
        if not trainer.strategy.reduce_boolean_decision(self.requested, all=False):
            return
        # One name for all ranks: a sharded checkpoint is a directory that every rank writes into.
        path = trainer.strategy.broadcast(str(next_hpc_checkpoint(trainer.default_root_dir)))
        trainer.save_checkpoint(path)
        rank_zero_info(f"Requeue signal: saved {path} at step {trainer.global_step}; requeueing the job.")
        if trainer.is_global_zero:
            job = os.environ["SLURM_JOB_ID"]
            if "SLURM_ARRAY_JOB_ID" in os.environ:
                job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
            if subprocess.call(["scontrol", "requeue", job]) != 0:
                rank_zero_warn(f"`scontrol requeue {job}` failed: resubmit the job; it resumes from {path}.")
        trainer.should_stop = True
