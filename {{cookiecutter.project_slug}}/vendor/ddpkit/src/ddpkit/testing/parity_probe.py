"""A test-only callback that records, on every rank, what the rank trained on and what it logged.

The suite gives it to main.py as `--trainer.callbacks+=ddpkit.testing.parity_probe.Probe`. When a stage ends, each
rank writes `<default_root_dir>/probe/<stage>-rank<r>.json` and, after fit and if asked, weights to `fit-rank<r>.pt`.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn

from .fingerprints import TrainSamples, dataset_fingerprint, rank_difference
from .slim import slim

DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def leaves(batch: Any) -> list[Tensor]:
    """The tensors of a batch that is a tensor, or a tuple, list or dict of them (nested), in a fixed order."""
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for key in sorted(batch, key=str) for t in leaves(batch[key])]
    if isinstance(batch, (tuple, list)):
        return [t for item in batch for t in leaves(item)]
    return []


def per_sample(batch: Any) -> list | None:
    """The samples of a batch collated into sequences of samples (torchvision's detection references' `tuple(zip(
    *samples))`: a tuple of images, each of its own size, and a tuple of targets), one tuple each; None for a batch of
    batched tensors. Such a batch is a tuple or list of tuples or lists, all of one length."""
    if isinstance(batch, (tuple, list)) and batch and all(isinstance(part, (tuple, list)) for part in batch):
        if len({len(part) for part in batch}) == 1:
            return list(zip(*batch, strict=True))
    return None


def batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor, or the length of its sequences of samples
    (`per_sample`), where the first tensor is the first image and its first dimension the image's channels."""
    samples = per_sample(batch)
    return len(samples) if samples is not None else len(leaves(batch)[0])


def sample_keys(batch: Any) -> list[str]:
    """One identity per sample of a collated batch, for a loader whose samples cannot be read before collation
    (fingerprints.TrainSamples): a hash of its row in every tensor of the batch (of its every tensor, for a batch of
    sequences of samples). Floats are hashed as float32, which holds the loaded values exactly in any run precision
    (64-true converts float32 up)."""
    samples = per_sample(batch)
    if samples is not None:
        rows = [[_exact(t) for t in leaves(list(sample))] for sample in samples]
        return [hashlib.sha1(b"".join(t.numpy().tobytes() for t in row)).hexdigest() for row in rows]
    tensors = [_exact(t) for t in leaves(batch) if t.ndim and len(t) == batch_len(batch)]
    return [hashlib.sha1(b"".join(t[i].numpy().tobytes() for t in tensors)).hexdigest() for i in range(len(tensors[0]))]


def _exact(tensor: Tensor) -> Tensor:
    tensor = tensor.detach().cpu()
    return tensor.float() if tensor.is_floating_point() else tensor.long()


class NoDropout(L.Callback):
    """Sets the rate of every dropout layer to 0 when fit starts, for runs that must train the same weights.

    Dropout draws a different mask for a sample on 2 ranks than on 1 device (each rank has its own random
    stream): that is randomness, not a DDP bug, and it would hide real differences. Functional dropout
    (`F.dropout` in forward) is not reached: use `nn.Dropout` modules (the suite names a step that draws
    random numbers otherwise: configured.probe_training_step).
    """

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for module in pl_module.modules():
            if isinstance(module, DROPOUT):
                module.p = 0.0
            elif isinstance(module, nn.RNNBase):  # nn.LSTM's, nn.GRU's dropout between their layers
                module.dropout = 0.0


class ReversedBatches(L.Callback):
    """Reverses the order of the samples in every training batch: the same global batches, every sum over the
    batch (loss, gradients, BatchNorm's statistics) added in another order. Summation order alone: the rounding
    reference of a model that micro-batches would change (BatchNorm) or a data module that takes none."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if per_sample(batch) is not None:  # sequences of samples: a list reversed in place, a tuple left as it is
            for part in batch:
                if isinstance(part, list):
                    part.reverse()
            return
        n = batch_len(batch)
        for tensor in leaves(batch):
            if tensor.ndim and len(tensor) == n:  # per-sample rows; in place: the step gets this very batch
                tensor.copy_(tensor.flip(0))


class Probe(NoDropout):
    """Records training samples per step, logged metrics and evaluation sample counts, per rank; no dropout.

    Args:
        save_at_steps: Global steps after which to save a checkpoint to probe/step<k>.ckpt (mid-epoch
            resume points), the way ModelCheckpoint saves one with every_n_train_steps.
        resumable: Keep the optimizer's state in the checkpoints at `save_at_steps`, which other runs resume
            from, but at `weights_at`. Other checkpoints hold the weights and the loops' state (what the checks
            compare and evaluation loads): slim.py.
        weights_at: Of `save_at_steps`, the steps whose checkpoint holds no optimizer state with `resumable`, and
            its float64 weights and buffers as float32 (the one-step check's states, where it judges the gradient, not
            the optimizer's update, and every run starts from the float32 numbers: slim.in_float32).
        consume: Delete the checkpoint fit resumed from once its states are restored (rank 0): another run's
            resume state that nothing reads after, gone before this run writes its own (footprint.py).
        on_gpu_at: Of `save_at_steps`, the steps whose checkpoint is written with every tensor tagged as stored on
            cuda:0, as one written on GPUs (fake_cuda.py; another run resumes from it on CPU).
        names_only: File-name patterns of the checkpoints the checks read for their names alone, written with no
            tensors (slim.py).
        best: Keep the checkpoint callbacks' best checkpoints (off: last.ckpt alone, where no check reads a best).
        rank_weights: Save each rank's final weights to probe/fit-rank<r>.pt.
        fingerprint_data: Before fit, write each rank's fingerprints of the data module's train and val sets to
            probe/data-rank<r>.json; on several ranks, stop the run, every rank with the same error, where a rank's
            differ from rank 0's (a dataset built differently per process: nothing after it could be compared).
    """

    def __init__(
        self,
        save_at_steps: list[int] | None = None,
        resumable: bool = False,
        weights_at: list[int] | None = None,
        consume: bool = False,
        on_gpu_at: list[int] | None = None,
        names_only: list[str] | None = None,
        best: bool = True,
        rank_weights: bool = False,
        fingerprint_data: bool = False,
    ) -> None:
        self.save_at_steps = set(save_at_steps or ())
        resumes = self.save_at_steps - set(weights_at or ()) if resumable else set()
        self.full, self.consume = [f"step{k}.ckpt" for k in sorted(resumes)], consume
        self.single = [f"step{k}.ckpt" for k in sorted(self.save_at_steps - resumes)] if resumable else []
        self.cuda, self.names = [f"step{k}.ckpt" for k in sorted(on_gpu_at or ())], list(names_only or ())
        self.best, self.rank_weights, self.fingerprint_data = best, rank_weights, fingerprint_data
        self.record: dict = {"pid": os.getpid(), "batches": {}, "train": [], "val": [], "test": {}}
        self.eval_samples = 0
        self.samples: TrainSamples | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.record.update(rank=trainer.global_rank, world_size=trainer.world_size)
        # last.ckpt once, at fit's end: none of the checks reads an earlier one.
        slim(trainer, self.full, self.best, last_at_end=True, cuda=self.cuda, names=self.names, single=self.single)
        if self.fingerprint_data and stage == "fit":
            self.compare_data(trainer)

    def compare_data(self, trainer: L.Trainer) -> None:
        """Fingerprint this rank's datasets (fingerprints.py), write them, and fail where the ranks' differ."""
        sets = {name: getattr(trainer.datamodule, f"{name}_set", None) for name in ("train", "val")}
        mine = {name: dataset_fingerprint(dataset) for name, dataset in sets.items() if dataset is not None}
        out = Path(trainer.default_root_dir) / "probe"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"data-rank{trainer.global_rank}.json").write_text(json.dumps(mine))
        if trainer.world_size > 1:
            every = [None] * trainer.world_size
            torch.distributed.all_gather_object(every, mine)
            differs = rank_difference(every)
            if differs:
                raise RuntimeError(differs)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning has restored every state from ckpt_path by now, and reads the file no more.
        if self.consume and trainer.ckpt_path and trainer.is_global_zero:
            Path(trainer.ckpt_path).unlink(missing_ok=True)
        self.on_train_epoch_start(trainer, pl_module)  # Lightning does not start a resumed epoch again

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Before the loop iterates the loader: the fit's, or one built anew (reload_dataloaders_every_n_epochs).
        if self.samples is None or self.samples.loader is not trainer.train_dataloader:
            self.samples = TrainSamples(trainer.train_dataloader)
            self.record["samples_read"] = self.samples.read

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        # The samples as the dataset gave them, before the collate function padded or stacked them.
        keys = self.samples.keys(trainer.current_epoch) if self.samples is not None else None
        keys = sample_keys(batch) if keys is None else keys
        self.record["batches"].setdefault(str(trainer.current_epoch), []).append(keys)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        # What this rank's module logged this step (after any sync), at full precision.
        logged = {k: v.item() for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        self.record["train"].append({"step": trainer.global_step, **logged})
        if trainer.global_step in self.save_at_steps:
            self.save_at_steps.remove(trainer.global_step)  # once: micro-batches of one step share its number
            trainer.save_checkpoint(Path(trainer.default_root_dir) / "probe" / f"step{trainer.global_step}.ckpt")

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.eval_samples = 0

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.eval_samples = 0

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.eval_samples += batch_len(batch)

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.eval_samples += batch_len(batch)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            metrics = {k: v.item() for k, v in trainer.callback_metrics.items() if v.numel() == 1}
            self.record["val"].append({"epoch": trainer.current_epoch, "samples": self.eval_samples, **metrics})

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = {k: v.item() for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        self.record["test"] = {"samples": self.eval_samples, **metrics}

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        out = Path(trainer.default_root_dir) / "probe"
        out.mkdir(parents=True, exist_ok=True)
        rank, stage = trainer.global_rank, TrainerFn(stage).value  # "fit", "test", ...
        (out / f"{stage}-rank{rank}.json").write_text(json.dumps(self.record))
        if stage == "fit" and self.rank_weights:
            torch.save(pl_module.state_dict(), out / f"fit-rank{rank}.pt")


class OneStep(NoDropout):
    """Replays single optimizer steps from saved states: the one-step check's runs (check_onestep.py).

    The run trains `batches` global batches of each of its epochs (with no validation and no checkpoints). Before
    global batch k of the run (k = epoch x steps_per_epoch + its index in the epoch), it loads the state another run
    saved after k global batches (`states`/step<k x steps_per_batch>.ckpt: weights, buffers such as BatchNorm's
    statistics, and the optimizer's and schedule's states where saved: else a fresh optimizer) into the module and
    the optimizers, if there is one (global batch 0 starts from this run's own initialization). Lightning then trains
    that batch: global batch k is the same set of samples on any device count (GlobalBatchSampler), so runs on 1 and
    on N devices take the same step from the same state.
    It records, per global batch, the gradients each optimizer step sees (after the all-reduce and any unscaling:
    `on_before_optimizer_step`; a float64 one as the float32 nearest it, which is all the float32 and bf16 steps are
    judged against: check_onestep.py), the buffers and untrained weights before and after the step (of every tensor, a
    digest of the state the step started from), and the scalars the module logged in it; rank 0 writes them to
    probe/onestep.pt, and every rank a digest of its weights after each step and what it logged to
    probe/onestep-rank<r>.json (the ranks of a DDP run hold the same bits).

    Args:
        states: The folder of the saved states (another run's probe/ folder).
        steps_per_epoch: Optimizer steps of the runs' first epoch (the position of global batch k in the second).
        steps_per_batch: Optimizer steps per global batch (the saved states are named by optimizer step).
        batches: Global batches to train in each epoch.
        nudge: Each weight of a loaded state multiplied by 1 + nudge or 1 - nudge (a fixed pattern per global
            batch, the same in every run and on every rank): the check's second look (runs.NUDGE).
    """

    def __init__(
        self, states: str = "", steps_per_epoch: int = 1, steps_per_batch: int = 1, batches: int = 2, nudge: float = 0.0
    ) -> None:
        self.states, self.steps_per_epoch, self.steps_per_batch = Path(states), steps_per_epoch, steps_per_batch
        self.batches, self.nudge, self.loaded = batches, nudge, 0  # loaded: the loader's batches an epoch
        self.record: dict[int, dict] = {}
        self.digests: dict[int, dict] = {}
        self.current: dict | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.pytorch.callbacks import Checkpoint, GradientAccumulationScheduler

        # After the data module's setup, which sets the accumulation (micro-batches); a GradientAccumulationScheduler
        # sets it at each epoch's start: its largest here, each epoch's own in on_train_batch_start.
        most = [max(c.scheduling.values()) for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]
        trainer.limit_train_batches = self.batches * max([trainer.accumulate_grad_batches, *most])
        # Nothing to save: the steps' records are the result (a new list: Lightning is iterating the old one).
        trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, Checkpoint)]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if batch_idx == 0:  # the epoch's batches: `batches` optimizer steps of this epoch's accumulation
            self.loaded = self.loaded or trainer.fit_loop.max_batches
            trainer.fit_loop.max_batches = min(self.loaded, self.batches * trainer.accumulate_grad_batches)
        if batch_idx % trainer.accumulate_grad_batches:
            return  # a later micro-batch of the same step
        k = trainer.current_epoch * self.steps_per_epoch + batch_idx // trainer.accumulate_grad_batches
        saved = self.states / f"step{k * self.steps_per_batch}.ckpt"
        if k:
            if not saved.is_file():
                raise FileNotFoundError(f"no saved state to replay global batch {k} from: {saved}")
            state = torch.load(saved, map_location="cpu", weights_only=False)
            weights = {name for name, _ in pl_module.named_parameters()}
            pl_module.load_state_dict(nudged(state["state_dict"], weights, self.nudge, k))
            for n, optimizer in enumerate(trainer.optimizers):
                if "optimizer_states" in state:  # floating state cast to the parameters' dtype
                    optimizer.load_state_dict(state["optimizer_states"][n])
                else:  # a state saved without it (commands.run_args): every run's step starts from a fresh optimizer
                    optimizer.state.clear()
            for config, schedule in zip(trainer.lr_scheduler_configs, state.get("lr_schedulers", []), strict=False):
                config.scheduler.load_state_dict(schedule)
        self.current = {"before": _copy(pl_module.state_dict()), "grads": []}
        self.record[k] = self.current

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if self.current is not None:
            named = pl_module.named_parameters(remove_duplicate=False)  # a tied weight under each of its names
            copies: dict[int, Tensor] = {}  # one copy of a tied weight's gradient, saved once (GPT-2 small's: 31%)
            grads = {}
            for n, p in named:
                if p.grad is not None:
                    if id(p) not in copies:  # a float64 one (the exact step's) as the float32 nearest it
                        grad = p.grad.detach()
                        copies[id(p)] = grad.float() if grad.dtype == torch.float64 else grad.clone()
                    grads[n] = copies[id(p)]
            self.current["grads"].append(grads)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches or self.current is None:
            return  # the step is not over
        after = _copy(pl_module.state_dict())
        self.current["logged"] = {k: v.item() for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        k = next(k for k, v in self.record.items() if v is self.current)
        self.digests[k] = {"weights": digests(after), "logged": self.current["logged"]}
        # The record keeps whole only the tensors the step gave no gradient (buffers, parameters nothing trained),
        # before and after it, which the check judges; of the others, a digest of the state it started from (the
        # check's same-start test). Whole, every record held 3 copies of the model a step (36 x its float64 weights
        # over the 5 runs: docs/measurements.md, 2026-12-06).
        trained = {name for grads in self.current["grads"] for name in grads}
        before = self.current["before"]
        self.current["started_from"] = digests(before)
        self.current["before"] = {name: t for name, t in before.items() if name not in trained}
        self.current["after"] = {name: t for name, t in after.items() if name not in trained}
        if not k:  # from each run's own initialization: its start is checked (digests), its step is not judged
            self.current["grads"] = []
        self.current = None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        out = Path(trainer.default_root_dir) / "probe"
        out.mkdir(parents=True, exist_ok=True)
        if trainer.global_rank == 0:
            torch.save(self.record, out / "onestep.pt")
        (out / f"onestep-rank{trainer.global_rank}.json").write_text(json.dumps(self.digests))


def nudged(state: dict[str, Tensor], weights: set[str], nudge: float, seed: int) -> dict[str, Tensor]:
    """`state` with each of its `weights` multiplied elementwise by 1 + nudge or 1 - nudge, in its stored precision
    (float32, or float64 where a state keeps its optimizer's: every run then casts the same nudged numbers), by a
    pattern drawn from `seed` alone."""
    if not nudge:
        return state
    signs = torch.Generator().manual_seed(seed)
    out = dict(state)
    for name in sorted(weights & state.keys()):
        t = state[name]
        sign = torch.randint(0, 2, t.shape, generator=signs).to(t.dtype) * 2 - 1
        out[name] = t * (1 + nudge * sign)
    return out


def _copy(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: t.detach().cpu().clone() for name, t in state.items()}


def digests(state: dict[str, Tensor]) -> dict[str, str]:
    """Each tensor's bytes as a SHA-1: equal digests are the same bits."""
    return {name: hashlib.sha1(t.contiguous().numpy().tobytes()).hexdigest() for name, t in state.items()}
