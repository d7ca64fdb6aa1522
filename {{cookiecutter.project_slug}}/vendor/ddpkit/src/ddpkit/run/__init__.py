"""Running a fit: the project CLI (cli.py) and what it wires into Lightning's: the fail-fast checks (checks.py,
ckpt_paths.py), where runs write (logdirs.py, checkpoints.py, predictions.py, trackers.py), the DDP strategy
(strategy.py), stopping, requeueing and hangs (stop.py, requeue.py, hang.py, processes.py), a tuning trial's
report (trial.py), and the fault injector (faults.py, `python -m ddpkit.run.faults`)."""
