"""What DDP's find_unused_parameters costs per training step (docs/measurements.md, "find_unused_parameters"):
`python tests/library/measure_unused.py [ROUNDS]`.

One process, one thread (as each rank of a 2-process CPU run), a gloo group of one: DDP keeps its reducer and, with
find_unused_parameters, walks the autograd graph from the outputs after every forward. Steps of AdamW on the digits
example's MLP (64 -> 128 -> 128 -> 10, a rank's 32 samples of a global batch of 64) and of families.py's ResNet-18
at width 16 (16 images of 3 x 16 x 16), with and without the setting, in alternating blocks; CPU time of the process (a busy machine's wait for a core
left out), medians of the blocks.
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from families import ResNet18


def digits_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The digits example's MLP (hidden_dim 128, num_layers 2) and a rank's batch of 32."""
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    return net, torch.rand(32, 64), torch.randint(0, 10, (32,))


def resnet() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """families.ResNet18 at width 16 and 16 images of 3 x 16 x 16."""
    return ResNet18(norm="group", width=16).net, torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))


def step_seconds(build, find_unused: bool, steps: int) -> float:
    """CPU seconds per step (forward, loss, backward, AdamW) of `steps` steps under DDP."""
    torch.manual_seed(0)
    net, x, y = build()
    model = DistributedDataParallel(net, find_unused_parameters=find_unused)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(5):  # warm-up
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    start = time.process_time()  # CPU time: on a loaded machine, waiting for a core would swamp the difference
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return (time.process_time() - start) / steps


def main(rounds: int) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    for name, build, steps in (("digits MLP", digits_mlp, 2000), ("ResNet-18 width 16", resnet, 100)):
        times = {False: [], True: []}
        for _ in range(rounds):
            for find_unused in (False, True):
                times[find_unused].append(step_seconds(build, find_unused, steps))
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"{name}: {off * 1e6:.0f} us/step without, {on * 1e6:.0f} with find_unused_parameters: "
              f"+{(on - off) * 1e6:.0f} us, {100 * (on - off) / off:+.1f}% (medians of {rounds} blocks of {steps})")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
