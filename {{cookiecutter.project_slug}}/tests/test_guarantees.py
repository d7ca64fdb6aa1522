"""The guarantees of ddpkit on this project's model and data (those config.yaml selects): 1 vs 2 devices,
torchrun, accumulation, exact resume, evaluation, predictions, logs, multi-node, sharding (ddpkit.testing).
Select one like any test here: pytest "tests/test_guarantees.py::test_weights_match_1_vs_2_devices"."""

from ddpkit.testing.guarantees import *  # noqa: F403
