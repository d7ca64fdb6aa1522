"""The reference for `lm.py`: the language-model example's training written the plain PyTorch DDP way.

Launch with torchrun, one process per device:

    torchrun --nproc_per_node 1 benchmarks/lm_raw.py --project /tmp/ddp-digits --tokens tokens.bin --out raw.json

It trains the baked project's own `GPT` (imported from `lm/gpt.py`, which needs no Lightning) on the token
file that `lm.py` generates, split and ordered as the example's `TextDataModule` does (`--val-fraction` of the
ids from the end for validation; sample order seeded with seed + epoch, rank r taking slice r of every global
batch), with configs/lm.yaml's optimizer (AdamW in two groups: decay on the weight matrices only) and schedule
(linear warmup, then cosine to 0.1 x lr at the last step), bf16 autocast with `--precision bf16-mixed`, fused
AdamW on CUDA, and each transformer block compiled with `--compile` (as the example's `--model.compile true`).
Each epoch it evaluates on the validation set and rank 0 saves a checkpoint, as the template does.
Lightning is not imported.
"""

import argparse
import json
import math
import os
import random
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from raw_ddp import SameOrderSampler, baked_module, leave  # benchmarks/ is on sys.path as the script's directory


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--project", type=Path, required=True, help="a project baked with lm_example=yes")
    p.add_argument("--tokens", type=Path, required=True, help="token ids, uint16 (lm.py writes it)")
    p.add_argument("--out", type=Path, required=True, help="JSON file for rank 0's timings")
    p.add_argument("--weights", type=Path, help="where rank 0 saves the final GPT state_dict")
    p.add_argument("--ckpt-dir", type=Path, help="where rank 0 saves a checkpoint each epoch")
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    # configs/lm.yaml's optimizer and schedule
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-every", type=int, default=10, help="all-reduce and print the step loss every N steps")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block in place")
    return p


def splits(tokens: Path, block_size: int, val_fraction: float) -> tuple[TensorDataset, TensorDataset]:
    """Training and validation (input, target) sequences, cut as the example's TextDataModule cuts them."""
    ids = torch.frombuffer(bytearray(tokens.read_bytes()), dtype=torch.uint16).long()
    cut = int(len(ids) * (1 - val_fraction))

    def chunks(part: torch.Tensor) -> TensorDataset:
        n = (len(part) - 1) // block_size
        return TensorDataset(
            part[: n * block_size].view(n, block_size), part[1 : n * block_size + 1].view(n, block_size)
        )

    return chunks(ids[:cut]), chunks(ids[cut:])


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    """configs/lm.yaml's schedule as a LambdaLR factor: linear warmup to the lr, then a half cosine to min_ratio."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = parser().parse_args()
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    gpu = args.accelerator == "gpu"
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo")

    # The template's seed_everything(42) runs before the model is built: the same initial weights.
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    gpt = baked_module(args.project, "lm.gpt").GPT
    model = gpt(args.vocab_size, args.block_size, args.n_layers, args.d_model, args.n_heads).to(device)
    if args.compile:
        for block in model.blocks:
            block.compile()
    ddp_model = DistributedDataParallel(model, device_ids=[local_rank] if gpu else None)
    # Weight decay on the weight matrices, none on biases, norms and the position table.
    matrices = {n for n, p in model.named_parameters() if p.dim() >= 2 and "pos_emb" not in n}
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in matrices]},
        {"params": [p for n, p in model.named_parameters() if n not in matrices], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        groups, lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay, fused=True if gpu else None
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16-mixed" else nullcontext()

    train_set, val_set = splits(args.tokens, args.block_size, args.val_fraction)
    sampler = SameOrderSampler(len(train_set), args.global_batch_size, world, rank, args.seed)
    train_loader = DataLoader(train_set, batch_size=sampler.batch_size, sampler=sampler, pin_memory=gpu)
    val_indices = list(range(rank, len(val_set), world))  # every validation sequence on exactly one rank
    val_loader = DataLoader(val_set, batch_size=sampler.batch_size, sampler=val_indices, pin_memory=gpu)
    factor = warmup_cosine(args.warmup_steps, args.epochs * len(train_loader), args.min_lr_ratio)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    starts: list[tuple[int, float, float]] = []
    windows: list[list] = []  # [epoch, start, end, steps]: the device idle at both ends
    first_step_wall = None
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        loss_sum = torch.zeros((), device=device)
        for i, (x, y) in enumerate(train_loader):
            if first_step_wall is None:
                first_step_wall = time.time()
            if i == 0:
                sync(device)
                windows.append([epoch, time.perf_counter(), None, 0])
            # The batch is fetched and the step is about to run: where the template's timer records.
            starts.append((epoch, time.perf_counter(), time.process_time()))
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                logits = ddp_model(x)  # (B, T, vocab)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            schedule.step()
            loss_sum += loss.detach()
            step += 1
            windows[-1][3] += 1
            if step % args.log_every == 0:  # the global step loss, printed as a hand-written loop does
                step_loss = loss.detach().clone()
                dist.all_reduce(step_loss)
                if rank == 0:
                    print(f"step {step} loss {step_loss.item() / world:.4f}", flush=True)
        sync(device)
        windows[-1][2] = time.perf_counter()

        ddp_model.eval()
        totals = torch.zeros(2, device=device)  # loss summed over tokens, tokens
        with torch.no_grad(), autocast:
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(ddp_model(x).flatten(0, 1), y.flatten(), reduction="sum")
                totals += torch.stack([loss.float(), torch.tensor(float(y.numel()), device=device)])
        epoch_loss = loss_sum.clone()
        dist.all_reduce(totals)
        dist.all_reduce(epoch_loss)
        if rank == 0:
            train_loss = epoch_loss.item() / (world * len(train_loader))
            print(
                f"epoch {epoch} train/loss {train_loss:.4f} val/loss {(totals[0] / totals[1]).item():.4f}", flush=True
            )
            if args.ckpt_dir:
                args.ckpt_dir.mkdir(parents=True, exist_ok=True)
                state = {"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save(state, args.ckpt_dir / "last.pt")

    if rank == 0:
        if args.weights:
            torch.save(model.state_dict(), args.weights)
        record = {"starts": starts, "windows": windows, "first_step_wall": first_step_wall, "world_size": world}
        args.out.write_text(json.dumps(record))
    leave()


if __name__ == "__main__":
    main()
