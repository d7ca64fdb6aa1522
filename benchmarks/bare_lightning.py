"""The Lightning floor: the raw loop's training in the smallest LightningModule and a bare Trainer.

    python benchmarks/bare_lightning.py --project /tmp/ddp-digits --out times.json --devices 2

Same model, data order, optimizer, seed and every-10-steps loss all-reduce as
`raw_ddp.py` (whose sampler and data loading it imports), run by
`Trainer(strategy="ddp")` with Lightning's own launcher and nothing else: no
logger, checkpoints, progress bar or model summary. What this costs over the raw
loop is Lightning's own per-step work; what the template costs over this is the
template's (its defaults, callbacks and data pipeline).
"""

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from raw_ddp import SameOrderSampler, baked_module, parser, template_split  # benchmarks/ is on sys.path
from steptimer import StepTimer


class Bare(L.LightningModule):
    def __init__(self, model: torch.nn.Module, args) -> None:
        super().__init__()
        self.model, self.args = model, args

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        if (self.global_step + 1) % self.args.log_every == 0:  # the raw loop's periodic global loss
            self.log("train/loss", loss.detach(), sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val/acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.args.lr, weight_decay=self.args.weight_decay)

    def train_dataloader(self):
        sampler = SameOrderSampler(
            len(self.train_set), self.args.global_batch_size, self.trainer.world_size, self.global_rank, self.args.seed
        )  # Lightning calls set_epoch on it every epoch
        return DataLoader(self.train_set, batch_size=sampler.batch_size, sampler=sampler)

    def val_dataloader(self):
        world, rank = self.trainer.world_size, self.global_rank
        indices = list(range(rank, len(self.val_set), world))
        return DataLoader(self.val_set, batch_size=self.args.global_batch_size // world, sampler=indices)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--devices", type=int, default=1, help="processes; Lightning's launcher starts the others")
    args = p.parse_args()
    os.environ.setdefault("BENCH_TIMES", str(args.out))  # where StepTimer writes (the ranks inherit it)
    torch.set_float32_matmul_precision(args.matmul_precision)  # every rank runs main()
    L.seed_everything(args.seed, verbose=False)  # before the model: the raw loop's initial weights
    module = Bare(baked_module(args.project, "digits.model").MLP(64, args.hidden_dim, args.num_layers, 10), args)
    module.train_set, module.val_set = template_split(args.project)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="ddp",
        precision=args.precision,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the sampler above already shards
        callbacks=[StepTimer()],
        default_root_dir=args.out.parent,
    )
    trainer.fit(module)
    # As raw_ddp.py ends: leave together, then skip the interpreter shutdown in which gloo's threads can abort.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
