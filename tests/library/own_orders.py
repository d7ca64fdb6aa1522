"""Data modules for test_sample_order.py, selected by class path (`--data own_orders.OwnSampler`)."""

from torch.utils.data import DataLoader, RandomSampler

from ddpkit.data.order import weighted_order
from ddpkit.testing.toy import ToyData


class OwnSampler(ToyData):
    """The toy data with train_dataloader() overridden: a DataLoader over a RandomSampler of its own."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.micro_batch(), sampler=RandomSampler(self.train_set))


class Weighted(ToyData):
    """The toy data in an order of weighted draws with replacement (later samples drawn more)."""

    def train_order(self, seed: int, epoch: int):
        return weighted_order([1 + i % 4 for i in range(self.train_size)], self.train_size, seed, epoch)
