"""A callback for the tune tests: each rank prints the values it trains with, read from the model and the optimizer
themselves (not from a config or the worker's log), so a rank that had drawn its own values would show them."""

import lightning as L


class ValueProbe(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        width = pl_module.net[0].out_features  # the toy's first layer: hidden_dim wide
        print(f"VALUE_PROBE global={trainer.global_rank} lr={lr!r} hidden_dim={width}", flush=True)
