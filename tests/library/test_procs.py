"""How the library's tests start the toy's runs (procs.py): forked from a server that imported its CLI, unless a
variable must act when an interpreter starts."""

import os

from procs import ON_PATH, fake_gpus_env, forks, toy, toy_server

from ddpkit.testing.helpers import exit_status, run_main


def test_a_toy_run_forks_unless_a_variable_acts_at_start_up(tmp_path):
    """Variables read at run time fork; the interpreter's own (PYTHON*), OpenMP's and the fake GPUs' (a
    sitecustomize) start a fresh `python -m ddpkit.testing.toy`. Both parse a command to the same configuration."""
    assert forks(None) and forks({}) and forks({"PYTHONUNBUFFERED": "1", "GRAPH_PROBE_OUT": "out.json"})
    gpus = fake_gpus_env(tmp_path / "site", 2)
    for env in ({"OMP_NUM_THREADS": "1"}, {"PYTHONHASHSEED": "0"}, {"MKL_NUM_THREADS": "1"}, gpus):
        assert not forks(env), env
    args = ("fit", "--print_config", "--trainer.accelerator", "cpu")
    forked, fresh = toy(*args, cwd=tmp_path), toy(*args, cwd=tmp_path, env={"PYTHONHASHSEED": "0"})
    assert forked.returncode == fresh.returncode == 0, (forked.stdout[-2000:], fresh.stdout[-2000:])
    assert forked.args[0] == "main.py" and fresh.args[:3][1:] == ["-m", "ddpkit.testing.toy"], (forked.args, fresh.args)
    assert "model:" in forked.stdout and forked.stdout == fresh.stdout


def test_a_forked_runs_exit_status_is_its_own_and_absent_while_it_runs(tmp_path):
    """The status a forked run's waiter leaves beside its output: none before the run, then the run's own (2 for a
    flag the CLI refuses, 0 for a run that ends well), as a fresh process would return it."""
    log, env = tmp_path / "out.txt", {**os.environ, **ON_PATH}
    assert exit_status(log) is None
    refused = run_main("fit", "--no_such_flag", "1", cwd=tmp_path, env=env, log=log, server=toy_server())
    assert refused.returncode == exit_status(log) == 2, refused.stdout[-2000:]
    assert "no_such_flag" in refused.stdout
    printed = run_main("fit", "--print_config", cwd=tmp_path, env=env, log=log, server=toy_server())
    assert printed.returncode == exit_status(log) == 0 and "model:" in printed.stdout, printed.stdout[-2000:]
