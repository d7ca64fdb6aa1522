"""The guarantee suite's fixtures (ddpkit.testing.plugin): the real runs of main.py that the tests in
test_guarantees.py compare, on the model and data config.yaml selects."""

pytest_plugins = ["ddpkit.testing.plugin"]
