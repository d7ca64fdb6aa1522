"""A test-only callback that records which parameter elements got no gradient in a run (`GradientPeaks`): the float64
checks leave them out (bounds.no_gradient). The suite gives it to the first wave's float64 runs (commands.run_args).
"""

from pathlib import Path

import lightning as L
import torch
from torch import Tensor


class GradientPeaks(L.Callback):
    """Records the largest |gradient| each parameter element saw over the run (after the all-reduce), the same on
    every rank; rank 0 writes to probe/no-gradient.pt, per parameter, which of its elements got none: a peak at most
    NO_GRADIENT of the model's largest (a mask of bools, an eighth of the float64 peaks' size). Those elements hold
    only rounding (the key's bias in attention, a bias before BatchNorm: their gradient is zero but for rounding),
    which an optimizer like AdamW turns into steps: the float64 checks leave them out (bounds.no_gradient)."""

    def __init__(self) -> None:
        self.peaks: dict[str, Tensor] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        for name, p in pl_module.named_parameters(remove_duplicate=False):
            if p.grad is not None:
                peak = p.grad.detach().abs()
                self.peaks[name] = torch.maximum(self.peaks[name], peak) if name in self.peaks else peak.clone()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.global_rank == 0 and self.peaks:
            out = Path(trainer.default_root_dir) / "probe"
            out.mkdir(parents=True, exist_ok=True)
            top = max((t.max().item() for t in self.peaks.values() if t.numel()), default=0.0)
            masks = {name: (t <= NO_GRADIENT * top).cpu() for name, t in self.peaks.items()}
            torch.save(masks, out / NO_GRADIENT_FILE)


# A gradient element whose largest |value| over the run is at most this fraction of the model's largest got no
# gradient: rounding only. Float64, families.GPT2 (seed 0): the key biases' peaks 3e-21 to 4e-20 of the largest, the
# smallest real ones (a query bias) 8e-6; 1e-12 is 1e6 from either (docs/measurements.md, "No gradient").
NO_GRADIENT = 1e-12
NO_GRADIENT_FILE = "no-gradient.pt"
