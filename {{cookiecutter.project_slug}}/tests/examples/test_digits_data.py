"""The bundled data loads, splits and batches as documented."""

import pytest
import torch

from {{ cookiecutter.package_name }}.digits.data import DigitsDataModule, load_digits


def test_bundled_digits_shape_and_range():
    """1,797 images of 64 pixels scaled to [0, 1], labels 0..9, about 180 of each."""
    data = load_digits()
    x, y = data.tensors
    assert x.shape == (1797, 64) and x.dtype == torch.float32
    assert x.min() == 0.0 and x.max() == 1.0
    assert torch.bincount(y).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_splits_are_disjoint_and_sized():
    """Train/val/test are 1079/359/359 distinct samples, the same for the same split seed."""
    dm = DigitsDataModule()
    dm.setup("fit")
    dm.setup("test")
    parts = [set(s.indices) for s in (dm.train_set, dm.val_set, dm.test_set)]
    assert [len(p) for p in parts] == [1079, 359, 359]
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    again = DigitsDataModule()
    again.setup("fit")
    assert again.train_set.indices == dm.train_set.indices


def test_train_loader_yields_full_global_batches_on_one_device():
    """Without a trainer the module acts as 1 device: 16 batches of 64."""
    dm = DigitsDataModule(global_batch_size=64)
    dm.setup("fit")
    sizes = [len(y) for _, y in dm.train_dataloader()]
    assert sizes == [64] * 16


def test_missing_data_path_fails_in_prepare_data(tmp_path):
    """A data path that does not exist is reported with the flag to fix it."""
    dm = DigitsDataModule(data_path=str(tmp_path / "nope.csv"))
    with pytest.raises(FileNotFoundError, match="--data.data_path"):
        dm.prepare_data()


def test_custom_csv_path(tmp_path):
    """A plain CSV with the same columns trains like the bundled file."""
    x, y = load_digits().tensors
    rows = torch.cat([(x[:200] * 16).round().long(), y[:200, None]], dim=1).tolist()
    path = tmp_path / "digits.csv"
    path.write_text("\n".join(",".join(map(str, r)) for r in rows))
    dm = DigitsDataModule(global_batch_size=16, val_size=40, test_size=40, data_path=str(path))
    dm.setup("fit")
    assert len(dm.train_set) == 120 and len(dm.train_dataloader()) == 7
