"""The reference: the generated project's training written the plain PyTorch DDP way.

Launch with torchrun, one process per device:

    torchrun --nproc_per_node 2 benchmarks/raw_ddp.py --project /tmp/ddp-digits --out times.json

It trains the project's own `MLP` (imported from its `model.py`, which needs no
Lightning) on the same digits split, in the same sample order, with the same
global batch, AdamW settings and seed as `python main.py fit` with the default
config, so the final weights match the template's to float rounding. Each epoch
it evaluates on the validation set (metrics summed over ranks), and rank 0
prints the epoch's numbers and saves a checkpoint: what a careful hand-written
loop does. Lightning is not imported.
"""

import argparse
import csv
import gzip
import importlib
import json
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Sampler, Subset, TensorDataset, random_split


class SameOrderSampler(Sampler[int]):
    """DistributedSampler's protocol (`set_epoch`, this rank's share) with the template's sample order.

    Each epoch: one permutation of the whole set seeded with seed + epoch, the tail
    that does not fill a global batch dropped, and rank r taking the r-th
    contiguous slice of every global batch (the template's GlobalBatchSampler).
    """

    def __init__(self, n: int, global_batch_size: int, world_size: int, rank: int, seed: int) -> None:
        self.n, self.global_batch_size, self.seed = n, global_batch_size, seed
        self.batch_size = global_batch_size // world_size
        self.rank, self.steps, self.epoch = rank, n // global_batch_size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        batches = order[: self.steps * self.global_batch_size].view(self.steps, -1)
        start = self.rank * self.batch_size
        return iter(batches[:, start : start + self.batch_size].reshape(-1).tolist())

    def __len__(self) -> int:
        return self.steps * self.batch_size


def load_digits(path: Path) -> TensorDataset:
    with gzip.open(path, "rt", newline="") as f:
        table = torch.tensor([[int(v) for v in row] for row in csv.reader(f) if row])
    return TensorDataset(table[:, :-1].float() / 16.0, table[:, -1].long())


def template_split(project: Path) -> tuple[Subset, Subset]:
    """The template's train and validation sets: 359 validation and 359 test samples drawn with seed 0."""
    full = load_digits(digits_csv(project))
    train_set, val_set, _ = random_split(full, [len(full) - 718, 359, 359], generator=torch.Generator().manual_seed(0))
    return train_set, val_set


def digits_csv(project: Path) -> Path:
    """The baked project's bundled data file, in the digits example's folder of the project's package."""
    (csv_path,) = project.glob("*/digits/digits.csv.gz")
    return csv_path


def baked_module(project: Path, name: str):
    """A module of the baked project's package, e.g. `digits.model` (the code the project itself runs)."""
    if str(project) not in sys.path:
        sys.path.insert(0, str(project))
    return importlib.import_module(f"{digits_csv(project).parent.parent.name}.{name}")


def parser(doc: str | None = __doc__) -> argparse.ArgumentParser:
    """The arguments of this loop; `bare_lightning.py` adds its own to the same set."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--project", type=Path, required=True, help="a baked project directory")
    p.add_argument("--out", type=Path, required=True, help="JSON file for rank 0's timings")
    p.add_argument("--weights", type=Path, help="where rank 0 saves the final MLP state_dict")
    p.add_argument("--ckpt-dir", type=Path, help="where rank 0 saves a checkpoint each epoch")
    p.add_argument("--hidden-dim", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-every", type=int, default=10, help="all-reduce the step loss every N steps")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    p.add_argument(
        "--matmul-precision",
        choices=["highest", "high", "medium"],
        default="highest",
        help="torch.set_float32_matmul_precision; run.py passes what the template's default sets (TF32 on GPUs)",
    )
    return p


def main() -> None:
    args = parser().parse_args()
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    gpu = args.accelerator == "gpu"
    torch.set_float32_matmul_precision(args.matmul_precision)
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo")

    # The template's seed_everything(42) runs before the model is built: the same initial weights.
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model = baked_module(args.project, "digits.model").MLP(64, args.hidden_dim, args.num_layers, 10).to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[local_rank] if gpu else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if args.precision == "bf16-mixed" else nullcontext()

    train_set, val_set = template_split(args.project)
    sampler = SameOrderSampler(len(train_set), args.global_batch_size, world, rank, args.seed)
    train_loader = DataLoader(train_set, batch_size=sampler.batch_size, sampler=sampler, pin_memory=gpu)
    # Every validation sample on exactly one rank; sums are reduced over ranks, so no sample counts twice.
    val_indices = list(range(rank, len(val_set), world))
    val_loader = DataLoader(val_set, batch_size=args.global_batch_size // world, sampler=val_indices, pin_memory=gpu)

    starts: list[tuple[int, float, float]] = []
    first_step_wall = None
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        loss_sum = torch.zeros((), device=device)
        for x, y in train_loader:
            if first_step_wall is None:
                first_step_wall = time.time()
            # The batch is fetched and the step is about to run: where the template's StepTimer records.
            starts.append((epoch, time.perf_counter(), time.process_time()))
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                loss = F.cross_entropy(ddp_model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
            step += 1
            if step % args.log_every == 0:  # the global step loss, as the template logs it
                step_loss = loss.detach().clone()
                dist.all_reduce(step_loss)
                last_logged = (step_loss / world).item()

        ddp_model.eval()
        totals = torch.zeros(3, device=device)  # loss sum, correct, count
        with torch.no_grad(), autocast:
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = ddp_model(x)
                totals += torch.stack(
                    [
                        F.cross_entropy(logits.float(), y, reduction="sum"),
                        (logits.argmax(-1) == y).sum(),
                        y.new_tensor(len(y)),
                    ]
                ).float()
        epoch_loss = loss_sum.clone()
        dist.all_reduce(totals)
        dist.all_reduce(epoch_loss)
        if rank == 0:
            val_loss, val_acc = (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()
            train_loss = epoch_loss.item() / (world * len(train_loader))
            print(
                f"epoch {epoch} train/loss {train_loss:.4f} step loss {last_logged:.4f} "
                f"val/loss {val_loss:.4f} val/acc {val_acc:.4f}",
                flush=True,
            )
            if args.ckpt_dir:
                args.ckpt_dir.mkdir(parents=True, exist_ok=True)
                torch.save(
                    {"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()},
                    args.ckpt_dir / "last.pt",
                )

    if rank == 0:
        if args.weights:
            torch.save(model.state_dict(), args.weights)
        record = {
            "starts": starts,
            "first_step_wall": first_step_wall,
            "train_end_wall": time.time(),
            "world_size": world,
        }
        args.out.write_text(json.dumps(record))
    leave()


def leave() -> None:
    """End a rank whose work is written: with the others, and without the interpreter's shutdown."""
    # Leave together: a rank that tears down gloo while rank 0 still writes can abort (SIGABRT seen in CI).
    dist.barrier()
    dist.destroy_process_group()
    # Even then, gloo's threads aborted the interpreter's shutdown now and then ("terminate called without an
    # active exception", 1 run in ~40; upstream pytorch#179291 describes the race). Everything is written.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
