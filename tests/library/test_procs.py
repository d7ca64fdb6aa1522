"""How the library's tests start the toy's runs (procs.py): forked from a server that imported its CLI, unless a
variable must act when an interpreter starts."""

from procs import fake_gpus_env, forks, toy


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
