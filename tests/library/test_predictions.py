"""`predict` writes outputs that differ in shape from sample to sample (token sequences, detection boxes) without
padding, the same file on 1 and 2 devices; the writer's split and stack of a batch, and the suite's check on it."""

from types import SimpleNamespace

import pytest
import torch
from procs import concurrently, toy_ok

from ddpkit.run.predictions import sample_count, stack, unbatch
from ddpkit.testing import check_data

TIMEOUT = 300
PREDICT_SIZE = 359  # the toy's test set, which it predicts


def written(batches: list) -> object:
    """What the writer makes of these batches' predictions, through torch.save and a weights-only load."""
    samples = [sample for batch, count in batches for sample in unbatch(batch, count)]
    return stack(samples)


def test_tensors_of_one_shape_are_stacked_and_ragged_ones_kept_one_per_sample():
    """Two batches padded to their own longest sample (5 and 3 tokens): a list of 4 tensors, unpadded across
    batches; one shape throughout: one tensor, as before."""
    ragged = written([(torch.ones(2, 5), 2), (torch.zeros(2, 3), 2)])
    assert isinstance(ragged, list) and [tuple(t.shape) for t in ragged] == [(5,), (5,), (3,), (3,)]
    even = written([(torch.ones(2, 5), 2), (torch.zeros(2, 5), 2)])
    assert isinstance(even, torch.Tensor) and even.shape == (4, 5)


def test_a_list_holds_one_prediction_per_sample():
    """A detector's list of one dict per sample: a dict of lists, one entry per sample, each its own length;
    a tuple beside it stays several batched outputs."""
    boxes = [{"boxes": torch.ones(n, 4), "labels": torch.arange(n)} for n in (3, 0, 7)]
    out = written([((torch.arange(3), boxes), 3)])
    assert isinstance(out, tuple) and out[0].tolist() == [0, 1, 2]
    assert [len(b) for b in out[1]["boxes"]] == [3, 0, 7] and out[1]["labels"][2].tolist() == list(range(7))
    assert sample_count(out) == 3 and sample_count(out[1]) == 3
    tokens = written([([torch.arange(5), torch.arange(23)], 2), ([torch.arange(25)], 1)])
    assert [len(t) for t in tokens] == [5, 23, 25] and sample_count(tokens) == 3


def test_a_list_or_tensor_of_another_length_than_the_batch_is_refused():
    """Several outputs returned as a list (the old form): an error saying to use a tuple, not a silent mix-up."""
    with pytest.raises(ValueError, match="a list holds one prediction per sample; return several batched"):
        unbatch([torch.ones(4, 2), torch.ones(4, 3)], 4 + 1)
    with pytest.raises(ValueError, match=r"a tensor of shape \(3, 2\) for 4 samples"):
        unbatch(torch.ones(3, 2), 4)


def predictions_file(root) -> object:
    (path,) = root.rglob("predictions.pt")
    return path


def test_ragged_predictions_are_one_file_the_same_on_1_and_2_devices(tmp_path):
    """RaggedToy (tests/library/ragged.py) on 1 and 2 gloo processes: each sample's tokens padded only to its
    batch's longest, and its own 5-14 classes and scores; the two files are the same bytes and hold 359 samples
    (the suite's check passes on them), and the tokens of several lengths."""
    roots = {n: tmp_path / f"{n}dev" for n in (1, 2)}

    def predict(n: int) -> str:
        args = ["--model", "ragged.RaggedToy", "--trainer.accelerator", "cpu", "--trainer.devices", str(n)]
        return toy_ok("predict", *args, "--trainer.default_root_dir", str(roots[n]), cwd=tmp_path, timeout=TIMEOUT)

    concurrently(predict, [1, 2])
    one, two = (predictions_file(roots[n]) for n in (1, 2))
    assert one.read_bytes() == two.read_bytes()
    tokens, boxes = torch.load(one, weights_only=True)
    assert isinstance(tokens, list) and len({len(t) for t in tokens}) > 1  # batches padded to different lengths
    assert sample_count(boxes) == PREDICT_SIZE and {len(c) for c in boxes["classes"]} == set(range(5, 15))
    runs = {f"predict-{n}dev": SimpleNamespace(root=path.parent) for n, path in ((1, one), (2, two))}
    batch = {"predict_size": PREDICT_SIZE, "stages": ["predict"], "model": "RaggedToy"}
    check_data.test_predictions_are_one_file_in_dataset_order_the_same_on_1_and_2_devices(runs, batch)
