"""The streaming example: the digits become shards of unequal sizes once, and stream as 64-sample batches."""

from collections import Counter

from {{ cookiecutter.package_name }}.stream.data import DigitShards


def test_shards_are_written_once_with_the_digits_splits(tmp_path):
    """1,079 / 359 / 359 samples in shards of 50 to 150; a second prepare_data rewrites nothing."""
    data = DigitShards(shard_dir=str(tmp_path / "shards"))
    data.prepare_data()
    written = {p: p.stat().st_mtime_ns for p in (tmp_path / "shards").rglob("*.pt")}
    data.prepare_data()
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "shards").rglob("*.pt")} == written
    sizes = [len(s) for s in data.train_shards()]
    assert sum(sizes) == 1079 and min(sizes) >= 50 and max(sizes) <= 150 and len(set(sizes)) > 1
    assert [sum(len(s) for s in shards) for shards in (data.val_shards(), data.test_shards())] == [359, 359]


def test_an_epoch_streams_16_batches_of_distinct_samples(tmp_path):
    """On 1 process: 1,079 // 64 = 16 batches of 64 pixel rows and labels, no sample twice."""
    data = DigitShards(shard_dir=str(tmp_path / "shards"))
    data.prepare_data()
    data.setup("fit")
    batches = list(data.train_dataloader())
    assert len(batches) == 16 and all(x.shape == (64, 64) and y.shape == (64,) for x, y in batches)
    trained = Counter((x.numpy().tobytes(), int(y)) for xs, ys in batches for x, y in zip(xs, ys, strict=True))
    available = Counter((x.numpy().tobytes(), int(y)) for x, y in data.train_set)
    assert sum(trained.values()) == 16 * 64 and not trained - available  # no sample more often than it exists
