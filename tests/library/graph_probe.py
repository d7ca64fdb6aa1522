"""Callbacks for test_step_graph.py, added to a toy fit by class path (`--trainer.callbacks+=graph_probe.GraphProbe`).

`GraphProbe` tags every node of each training batch's autograd graph (from the loss's `grad_fn` down, leaving out
the parameters' AccumulateGrad nodes, which the parameters and DDP's reducer keep by design) with an object held
only by the node's `metadata`, and keeps weak references to the tags: a tag is alive exactly as long as its node.
(A `grad_fn` cannot be weakly referenced itself, and the Python object torch hands out for it lives only as long
as Python holds it, not as long as the node.) When the next batch starts, and when training ends, it counts the
tags still alive; at the end of fit it writes the counts to the JSON file named by GRAPH_PROBE_OUT.

`KeepLoss` keeps the last batch's loss, with its graph: the bug the probe must see.
"""

import json
import os
import weakref
from typing import Any

import lightning as L
import torch


class _Tag:
    """Owned by one autograd node's metadata: dies with the node."""


def tag_graph(root: Any) -> list[_Tag]:
    """Tag every node reachable from `root` but the AccumulateGrad leaves; the tags, once each."""
    tags, seen, todo = [], set(), [root]
    while todo:
        node = todo.pop()
        if node is None or type(node).__name__ == "AccumulateGrad":
            continue
        key = id(node.metadata)  # one dict per node, whichever Python object torch wraps the node in
        if key in seen:
            continue
        seen.add(key)
        tag = node.metadata.setdefault("graph_probe", _Tag())
        tags.append(tag)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return tags


class GraphProbe(L.Callback):
    """Counts, at the start of every training batch and at the end of training, the nodes of the previous batch's
    autograd graph still alive."""

    def __init__(self) -> None:
        self.tags: list[weakref.ref] = []
        self.records: list[dict] = []

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self.tags += [weakref.ref(tag) for tag in tag_graph(loss.grad_fn)]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._count(trainer, f"epoch {trainer.current_epoch} batch {idx} start")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._count(trainer, "train end")
        if trainer.is_global_zero:
            callbacks = sorted({type(c).__name__ for c in trainer.callbacks})
            with open(os.environ["GRAPH_PROBE_OUT"], "w") as out:
                json.dump({"callbacks": callbacks, "records": self.records}, out)

    def _count(self, trainer: L.Trainer, when: str) -> None:
        if self.tags:  # a backward ran since the last count
            alive = sum(ref() is not None for ref in self.tags)
            self.records.append({"when": when, "step": trainer.global_step, "nodes": len(self.tags), "alive": alive})
        self.tags = []


class KeepLoss(L.Callback):
    """Keeps each batch's loss until the next one: its whole graph stays alive through the next step."""

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self.loss = loss
