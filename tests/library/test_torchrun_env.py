"""torchrun's ranks watch their own agent, whatever launcher pid their environment inherited."""

import os
import subprocess
import sys


def dead_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_launcher_pid_inherited_from_outside_does_not_stop_torchrun_ranks(tmp_path):
    """A 2-process torchrun fit started with DDP_LAUNCHER_PID naming a dead process (left in the environment by an
    earlier `python main.py` in the same process, as a test runner or notebook does) trains to the end."""
    env = {**os.environ, "DDP_LAUNCHER_PID": str(dead_pid()), "OMP_NUM_THREADS": "1"}
    # Steps of 0.1 s: the fit outlasts the ranks' 1-second check of their launcher several times over.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "ddpkit.testing.toy", "fit", "--trainer.accelerator", "cpu", "--trainer.max_steps", "30",
           "--trainer.logger", "false",
           "--model", "ddpkit.testing.toy.FaultyClassifier", "--model.step_sleep", "0.1",
           "--trainer.default_root_dir", str(tmp_path), "--doctor.enabled", "false"]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    out = result.stdout + result.stderr
    assert "is gone; exiting" not in out, out[-3000:]
    assert result.returncode == 0, out[-3000:]
