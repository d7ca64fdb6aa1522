"""One of two gloo processes that sync torchmetrics metrics whose list states hold a different number of entries on
each rank, as ddpkit's round-robin evaluation leaves them (test_metrics.py). Prints the synced values as JSON.

usage: list_sync.py RANK PORT PATCH   (PATCH 1: through ddpkit's gather_uneven_lists; 0: torchmetrics alone)
"""

import json
import sys

import torch
import torch.distributed as dist
from torchmetrics import Metric
from torchmetrics.retrieval import RetrievalMAP

from ddpkit.lightning_internals import gather_uneven_lists

WORLD = 2


class Samples(Metric):
    """Keeps an entry per sample, as MeanAveragePrecision keeps each image's boxes; computes them in order."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("seen", default=[], dist_reduce_fx=None)

    def update(self, values: torch.Tensor) -> None:
        self.seen.extend(value.reshape(1) for value in values)

    def compute(self) -> torch.Tensor:
        return torch.cat(self.seen)


def queries(n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """n batches of 3 queries x 4 documents (indexes, scores, relevance), fixed by the batch's number."""
    batches = []
    for b in range(n):
        g = torch.Generator().manual_seed(b)
        indexes = torch.arange(3 * b, 3 * b + 3).repeat_interleave(4)
        batches.append((indexes, torch.rand(12, generator=g), torch.rand(12, generator=g) > 0.5))
    return batches


def synced(rank: int, patch: bool) -> dict:
    """5 samples and 5 batches dealt round-robin (rank 0 holds 3 of each, rank 1 2), and 4 samples (2 each)."""
    odd, even, retrieval = Samples(), Samples(), RetrievalMAP()
    for metric in (odd, even, retrieval):
        if patch:
            assert gather_uneven_lists(metric)
    odd.update(torch.arange(5.0)[rank::WORLD])
    even.update(torch.arange(4.0)[rank::WORLD])
    for indexes, scores, relevant in queries(5)[rank::WORLD]:
        retrieval.update(scores, relevant, indexes=indexes)
    return {"odd": odd.compute().tolist(), "even": even.compute().tolist(), "map": retrieval.compute().item()}


if __name__ == "__main__":
    rank, port, patch = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    print(json.dumps(synced(rank, patch)), flush=True)
    dist.destroy_process_group()
