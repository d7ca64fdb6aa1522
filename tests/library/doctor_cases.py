"""Runs with a known cause of poor scaling, for the doctor's tests: select them with --model / --data.

Each class adds exactly one cause to the library's toy module or data (ddpkit.testing.toy); this folder must be on
PYTHONPATH (procs.ON_PATH puts it there).
"""

import time

import torch
from torch.utils.data import ConcatDataset, Dataset

from ddpkit.testing.toy import ToyClassifier, ToyData


class _Sleepy(Dataset):
    """Wraps a dataset; every sample costs `delay_s` of waiting, like a slow disk or decoder."""

    def __init__(self, dataset: Dataset, delay_s: float) -> None:
        self.dataset, self.delay_s = dataset, delay_s

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        time.sleep(self.delay_s)
        return self.dataset[index]


class SlowData(ToyData):
    """The blobs with `sample_delay_ms` of loading time per training sample (data-bound).

    Args:
        sample_delay_ms: Sleep per training sample, in the loading process.
        global_batch_size: Samples per optimizer step over all devices.
    """

    def __init__(self, sample_delay_ms: float = 2.0, global_batch_size: int = 16) -> None:
        super().__init__(global_batch_size=global_batch_size)
        self.sample_delay_ms = sample_delay_ms

    def train_dataset(self) -> Dataset:
        return _Sleepy(super().train_dataset(), self.sample_delay_ms / 1000)


class ManyBlobs(ToyData):
    """The training blobs repeated, so that large global batches still give many steps per epoch.

    Args:
        repeat: Copies of the training split.
        global_batch_size: Samples per optimizer step over all devices.
    """

    def __init__(self, repeat: int = 8, global_batch_size: int = 1024) -> None:
        super().__init__(global_batch_size=global_batch_size)
        self.repeat = repeat

    def train_dataset(self) -> Dataset:
        return ConcatDataset([super().train_dataset()] * self.repeat)


class WideModel(ToyClassifier):
    """Millions of parameters, tiny batches, plain SGD: little compute per byte of gradient (comm-bound).

    Args:
        width: Width of the two hidden layers (2048: 4.3 M parameters, 17 MB of gradients). Not called
            hidden_dim: LightningCLI would carry the default model's hidden_dim over to this class.
    """

    def __init__(self, width: int = 2048) -> None:
        super().__init__(hidden_dim=width, num_layers=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)  # one pass over the weights: cheap next to the all-reduce


class MemoryHog(ToyClassifier):
    """One rank keeps a large tensor alive for the whole fit (memory imbalance).

    Args:
        hog_mb: Size of the extra tensor.
        hog_rank: The rank that holds it.
    """

    def __init__(self, hog_mb: int = 400, hog_rank: int = 1) -> None:
        super().__init__()
        self.hog_mb, self.hog_rank = hog_mb, hog_rank

    def on_fit_start(self) -> None:
        if self.global_rank == self.hog_rank:
            # ones, not empty: the pages must really be touched to count in the peak.
            self.hog = torch.ones(self.hog_mb * 2**18, device=self.device)  # 2**18 float32 = 1 MB


class Straggler(ToyClassifier):
    """One rank sleeps in every training step, like a throttled device or a busy host (straggler).

    Args:
        delay_ms: Extra time per step on the slow rank.
        slow_rank: The rank that sleeps.
    """

    def __init__(self, delay_ms: float = 100.0, slow_rank: int = 1) -> None:
        super().__init__()
        self.delay_ms, self.slow_rank = delay_ms, slow_rank

    def training_step(self, batch, batch_idx: int):
        if self.global_rank == self.slow_rank:
            time.sleep(self.delay_ms / 1000)
        return super().training_step(batch, batch_idx)


class Balanced(ToyClassifier):
    """Enough compute per step that data, communication and overheads are small (healthy, with ManyBlobs).

    1.1 M parameters x 1,024 samples per device (the sweep test's batch): ~7 GFLOP per step and rank
    against a 4.5 MB all-reduce, so the gloo all-reduce stays well under the 30% comm threshold.

    Args:
        width: Width of the two hidden layers.
    """

    def __init__(self, width: int = 1024) -> None:
        super().__init__(hidden_dim=width, num_layers=2)
