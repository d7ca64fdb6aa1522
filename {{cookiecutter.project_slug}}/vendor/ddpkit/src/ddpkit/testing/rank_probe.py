"""A callback for tests: each process prints the ranks and cluster environment Lightning chose.

Add it to a run with `--trainer.callbacks+=ddpkit.testing.rank_probe.RankProbe`.
"""

import time

import lightning as L


class RankProbe(L.Callback):
    """Prints one line per process at the start of training.

    Args:
        sleep_per_step: Seconds to sleep after each training step, to keep a tiny job running
            long enough for a test to signal it.
    """

    def __init__(self, sleep_per_step: float = 0.0) -> None:
        self.sleep_per_step = sleep_per_step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        env = type(trainer.strategy.cluster_environment).__name__
        # print, not a logger: every rank must report, and after a restore global_step is the resumed step.
        print(
            f"RANK_PROBE global={trainer.global_rank} local={trainer.local_rank} node={trainer.node_rank} "
            f"world={trainer.world_size} env={env} step={trainer.global_step}",
            flush=True,
        )

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        time.sleep(self.sleep_per_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The step each rank ended on, straight from the trainer rather than from a checkpoint.
        print(f"RANK_PROBE_END global={trainer.global_rank} step={trainer.global_step}", flush=True)
