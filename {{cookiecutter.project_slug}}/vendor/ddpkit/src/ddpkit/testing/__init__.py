"""The guarantee suite: the checks ddpkit promises for a project's own model and data, run with pytest.

The shape is scikit-learn's `parametrize_with_checks`: the library ships the checks, a project selects them
on its own classes. Here the classes are the ones the project's config.yaml selects, so a project's whole
selection is two files in its tests/:

    # tests/conftest.py: the fixtures the checks read (the shared runs of main.py), ddpkit.testing.plugin
    pytest_plugins = ["ddpkit.testing.plugin"]

    # tests/test_guarantees.py: the checks, collected there as that file's tests
    from ddpkit.testing.guarantees import *  # noqa: F403

The project is pytest's rootdir (where pyproject.toml is): its main.py is run, in real processes, on 1 and 2
CPU devices, under torchrun, SLURM and sharded (runs.py), and the checks (check_*.py) compare the runs.
A test of the suite is selected like any of the project's own, by its node id:
    pytest "tests/test_guarantees.py::test_weights_match_1_vs_2_devices"
and PARITY_ARGS adds arguments to every run: PARITY_ARGS="--model my_model.Other" pytest tests/test_guarantees.py
"""
