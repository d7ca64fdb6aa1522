"""A toy whose predictions differ in shape from sample to sample, as a seq2seq model's tokens or a detector's
boxes do (test_predictions.py selects it by class path)."""

import torch
from torch import Tensor

from ddpkit.testing.toy import ToyClassifier


class RaggedToy(ToyClassifier):
    """ToyClassifier whose `predict_step` returns, per batch, token sequences padded to a width of the batch's
    own (as a seq2seq `generate` does), and a list with one dict per sample: each sample's top classes and scores
    (5 to 14 of them, from its features), as a detector's boxes."""

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> tuple[Tensor, list[dict[str, Tensor]]]:
        logits = self(batch[0])  # (B, 10)
        lengths = 5 + (batch[0][:, 0].abs() * 7).long().clamp(max=9)  # (B,) in 5..14, a sample's own
        # Padded past this batch's longest by 0-2 (a generate() that stops late): each batch its own width, from
        # its first sample (batch_idx counts a rank's own batches: it differs on 2 devices).
        late = int(batch[0][0, 1].abs() * 10) % 3
        tokens = torch.zeros(len(logits), int(lengths.max()) + late, dtype=torch.long)
        boxes = []
        for i, n in enumerate(lengths.tolist()):
            tokens[i, :n] = torch.arange(n) % 10
            scores, classes = logits[i].repeat(2).topk(n)
            boxes.append({"classes": classes % 10, "scores": scores})
        return tokens, boxes
