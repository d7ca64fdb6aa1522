"""The streaming data module (ddpkit.data.streaming) on shards of unequal sizes, in real CPU runs (streams.py): every
sample of an epoch trained once over the ranks, the same steps on every rank, the global batches and the weights
of 1 device on 2, and a job killed with SIGKILL mid-epoch resumed on 2 and on 1 device ending with the
uninterrupted weights. Four launches: a 1-device reference on local .pt shards, and a 2-device job killed in
epoch 1, then its two resumes, on the same samples read through every reader: of the 12 shards, 3 are .pt
files, 3 WebDataset tars, 3 Parquet files read as a streaming `datasets` dataset and 3 chunks of a
`litdata.optimize` dataset (ddpkit.data.sources), so each check above holds for each adapter, with loader workers.
A reader whose library is not installed reads .pt files instead (test_the_2_device_runs_read_every_adapter
skips, naming it)."""

import json
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import concurrently, finish, start
from streams import READERS, SIZES, UnevenShards, write_shards
from torch.utils.data import IterableDataset

from ddpkit import GlobalBatchDataModule
from ddpkit.data.streaming import StreamingDataModule, StreamLoader, same_batches_every_epoch, shard_files
from ddpkit.parity import load_weights, max_abs

GLOBAL_BATCH = 32
STEPS_PER_EPOCH = sum(SIZES) // GLOBAL_BATCH  # 12: 385 samples, 1 left over each epoch
KILL_AT, RESUME_AT = 19, 18  # step 19 is the 8th of epoch 1; the checkpoint before it is step 18's
# float64, the same samples per step: only summation order differs. Measured 0 to 4.4e-16 over seeds 0-4, on
# local and on mixed shards (docs/measurements.md, 2026-12-02 streaming); 1e-12 catches any other sample.
BOUND = 1e-12

CONFIG = """
seed_everything: {seed}
model: {{class_path: streams.RecordingRegressor}}
data: {{class_path: streams.UnevenShards, init_args: {{root: {root}, global_batch_size: 32}}}}
doctor: {{enabled: false}}
dist_timeout: 60  # a rank left waiting (unequal step counts) fails the job in a minute, not five
trainer:
  accelerator: cpu
  strategy: ddp
  precision: 64-true
  max_epochs: 2
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  num_sanity_val_steps: 0
  callbacks:
    - class_path: ddpkit.run.checkpoints.CurrentModelCheckpoint
      init_args:
        every_n_train_steps: 3
        save_top_k: -1
        monitor: null
        filename: "step{{step}}"
        auto_insert_metric_name: false
"""
MAIN = "from pathlib import Path\nfrom ddpkit.run.cli import main\nmain(Path(__file__).with_name('config.yaml'))\n"


def launch(base: Path, name: str, devices: int, *args: str):
    """Start `main.py fit` on `devices` CPU processes; its records in base/name, its checkpoints below it."""
    (base / name).mkdir()
    cmd = [sys.executable, "main.py", "fit", "--trainer.devices", str(devices), "--model.record", str(base / name)]
    return start([*cmd, "--trainer.default_root_dir", str(base / name), *args], base)


def records(run: Path) -> dict[int, dict[int, list[int]]]:
    """{rank: {step: the ids it trained in that step (all its micro-batches)}}."""
    out: dict[int, dict[int, list[int]]] = {}
    for path in run.glob("rank*.jsonl"):
        steps = out.setdefault(int(path.stem[4:]), {})
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            steps.setdefault(entry["step"], []).extend(entry["ids"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The four runs: "one" (1 device, 4 micro-batches per step, local .pt shards), "killed" (2 devices, 2 loader
    workers each, SIGKILL at step 19), then "resumed2" and "resumed1" from the killed job's step-18 checkpoint;
    the last three read the mixed shards."""
    return _runs(tmp_path_factory.mktemp("streaming"))  # all local: HF_DATASETS_OFFLINE (tests/conftest.py)


def _runs(base: Path) -> dict:
    write_shards(base / "shards")
    fallback = write_shards(base / "mixed", READERS)
    (base / "config.yaml").write_text(CONFIG.format(seed=0, root=base / "shards"))
    (base / "main.py").write_text(MAIN)
    mixed = ("--data.root", str(base / "mixed"))
    first = {
        "one": lambda: launch(base, "one", 1, "--data.micro_batch_size", "8"),
        "killed": lambda: launch(
            base, "killed", 2, *mixed, "--data.num_workers", "2", "--model.kill_at_step", str(KILL_AT)
        ),
    }
    done = concurrently(lambda name: finish(first[name](), timeout=300), first)
    ckpt = base / "killed" / "checkpoints" / f"step{RESUME_AT}.ckpt"
    resume = (*mixed, "--ckpt_path", str(ckpt))
    second = {
        "resumed2": lambda: launch(base, "resumed2", 2, "--data.num_workers", "2", *resume),
        "resumed1": lambda: launch(base, "resumed1", 1, *resume),
    }
    done |= concurrently(lambda name: finish(second[name](), timeout=300), second)
    return {"base": base, "done": done, "ckpt": ckpt, "fallback": fallback}


def test_the_2_device_runs_read_every_adapter(runs):
    """The mixed shards are, in order, a .pt file, a tar, a Parquet file and a LitData chunk, three times over:
    distinct names, the sizes of the local shards, and each one's first sample is the local shard's."""
    if runs["fallback"]:
        pytest.skip(f"read as local .pt files, their libraries not installed: {runs['fallback']}")
    shards = UnevenShards(root=str(runs["base"] / "mixed")).train_shards()
    kinds = ["LocalShard", "TarShard", "HFShard", "LitDataChunk"] * 3
    assert [type(s).__name__ for s in shards] == kinds and len({s.name for s in shards}) == len(SIZES)
    assert [len(s) for s in shards] == SIZES
    starts = np.cumsum([0, *SIZES[:-1]]).tolist()
    assert [next(s.read())["id"].item() for s in shards] == starts


def test_runs_end_as_planned(runs):
    """The reference and the resumes exit 0 within the timeout (no end-of-epoch hang); the killed job dies by
    SIGKILL at step 19, after it wrote step 18's checkpoint."""
    done = runs["done"]
    for name in ("one", "resumed2", "resumed1"):
        assert done[name].returncode == 0, done[name].stdout[-3000:]
    assert done["killed"].returncode == -9, done["killed"].stdout[-3000:]
    assert max(records(runs["base"] / "killed")[0]) == KILL_AT - 1


def test_every_sample_of_an_epoch_once_over_ranks_with_equal_steps(runs):
    """Epoch 0 on 2 ranks (2 workers each) over shards of 5 to 70 samples: both ranks take 12 steps of 16
    samples, together 384 distinct samples, the 1-device run's; one sample (385 mod 32) is left over."""
    one, two = records(runs["base"] / "one")[0], records(runs["base"] / "killed")
    epoch0 = range(STEPS_PER_EPOCH)
    for rank in (0, 1):
        assert [len(two[rank][s]) for s in epoch0] == [GLOBAL_BATCH // 2] * STEPS_PER_EPOCH
    seen = Counter(i for rank in (0, 1) for s in epoch0 for i in two[rank][s])
    assert len(seen) == STEPS_PER_EPOCH * GLOBAL_BATCH and set(seen.values()) == {1}
    assert seen.keys() == {i for s in epoch0 for i in one[s]} and seen.keys() < set(range(sum(SIZES)))


def test_global_batches_equal_1_device_and_reshuffle_each_epoch(runs):
    """Step k's samples on the 2 ranks are step k's samples of 1 device x 4 micro-batches; epoch 1 orders the
    shards anew."""
    one, two = records(runs["base"] / "one")[0], records(runs["base"] / "killed")
    assert [sorted(two[0][s] + two[1][s]) for s in range(KILL_AT)] == [sorted(one[s]) for s in range(KILL_AT)]
    assert [set(one[s]) for s in range(12)] != [set(one[s]) for s in range(12, 24)]


def test_weights_equal_on_1_and_2_devices(runs):
    """Uninterrupted up to step 18, the 2-device job's weights are the 1-device run's (float64)."""
    one = load_weights(runs["base"] / "one" / "checkpoints" / f"step{RESUME_AT}.ckpt")
    assert max_abs(one, load_weights(runs["ckpt"])) <= BOUND


def test_checkpoint_holds_the_stream_position(runs):
    """The step-18 checkpoint records the loader's position: epoch 1, 6 global batches done."""
    ckpt = torch.load(runs["ckpt"], map_location="cpu", weights_only=False)
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 1, "global_batches_done": 6}]


@pytest.mark.parametrize("name", ["resumed2", "resumed1"])
def test_killed_mid_epoch_resumes_like_uninterrupted(runs, name):
    """Resumed from step 18 on 2 devices and on 1, the job trains steps 18-23 with the 1-device run's samples
    and ends with its weights."""
    one, resumed = records(runs["base"] / "one")[0], records(runs["base"] / name)
    steps = range(RESUME_AT, 2 * STEPS_PER_EPOCH)
    assert sorted(resumed[0]) == list(steps)
    assert [sorted(sum((resumed[r][s] for r in resumed), [])) for s in steps] == [sorted(one[s]) for s in steps]
    end = f"step{2 * STEPS_PER_EPOCH}.ckpt"
    weights = load_weights(runs["base"] / name / "checkpoints" / end)
    assert max_abs(load_weights(runs["base"] / "one" / "checkpoints" / end), weights) <= BOUND


def test_loader_splits_each_global_batch_by_rank_and_resumes_on_other_device_counts(tmp_path):
    """In one process: 1, 2, 4 and 8 ranks' loaders (with 0 to 3 workers) give the same global batches; a
    loader restored at global batch 5 continues with batch 5 on any of them."""
    write_shards(tmp_path)
    shards = shard_files(tmp_path)

    def batches(world: int, rank: int, workers: int = 0, done: int = 0) -> list[list[int]]:
        loader = StreamLoader(
            shards, streams=8, global_batch_size=32, world_size=world, rank=rank,
            micro_batch_size=32 // world, seed=0, num_workers=workers, current_epoch=lambda: 0,
        )  # fmt: skip
        loader.load_state_dict({"epoch": 0, "global_batches_done": done})
        return [batch["id"].tolist() for batch in loader]

    one = batches(1, 0)
    assert len(one) == STEPS_PER_EPOCH
    for world, workers in ((2, 1), (4, 2), (8, 0)):
        ranks = [batches(world, r, workers if r == 0 else 0) for r in range(world)]
        assert [sum(parts, []) for parts in zip(*ranks, strict=True)] == one  # rank r: the r-th slice
        resumed = [batches(world, r, done=5) for r in range(world)]
        assert [sum(parts, []) for parts in zip(*resumed, strict=True)] == one[5:]


def test_local_shards_of_each_format_read_from_any_start(tmp_path):
    """.pt (a dict of tensors), .npy and .jsonl shards: their length before reading, and read(start) yields the
    samples from `start` on, in order; shard_files lists a folder's shards by name."""
    torch.save({"a": torch.arange(5), "b": torch.arange(5) * 10}, tmp_path / "0.pt")
    np.save(tmp_path / "1.npy", np.arange(12).reshape(6, 2))
    (tmp_path / "2.jsonl").write_text("".join(json.dumps({"i": i}) + "\n" for i in range(4)))
    pt, npy, jsonl = shard_files(tmp_path)
    assert [len(pt), len(npy), len(jsonl)] == [5, 6, 4] and [pt.name, npy.name, jsonl.name] == [
        "0.pt",
        "1.npy",
        "2.jsonl",
    ]
    assert [(s["a"].item(), s["b"].item()) for s in pt.read(3)] == [(3, 30), (4, 40)]
    assert [s.tolist() for s in npy.read(4)] == [[8, 9], [10, 11]]
    assert list(jsonl.read(2)) == [{"i": 2}, {"i": 3}]


def test_a_shard_shorter_than_its_length_is_named(tmp_path):
    """A shard whose read() ends before len() samples fails the epoch naming the shard, not with a short batch."""

    class Short:
        name = "short-shard"

        def __len__(self):
            return 40

        def read(self, start=0):
            return iter(range(start, 30))

    loader = StreamLoader([Short()], streams=1, global_batch_size=8, world_size=1, rank=0, micro_batch_size=8, seed=0)
    with pytest.raises(
        ValueError, match="shard short-shard says it holds 40 samples, but its read\\(\\) ended after 30"
    ):
        list(loader)


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(10)


class SizedStream(Stream):
    """An iterable dataset that knows its length, as many do (a `__len__` for progress bars): still no indexing."""

    def __len__(self) -> int:
        return 10


@pytest.mark.parametrize("stream", [Stream, SizedStream])
def test_global_batch_module_given_an_iterable_dataset_points_to_streaming(stream):
    """A GlobalBatchDataModule whose train_dataset() is an IterableDataset, with or without a length, fails in setup
    with one line that names the streaming module, instead of `object of type ... has no len()` or torch's sampler
    error on every rank."""

    class Data(GlobalBatchDataModule):
        def train_dataset(self):
            return stream()

    with pytest.raises(
        TypeError,
        match=f"returned {stream.__name__}, an iterable dataset: .* ddpkit.data.streaming.StreamingDataModule",
    ):
        Data(global_batch_size=2).setup("fit")


class Numbered:
    """A shard of `length` samples numbered from `first`."""

    def __init__(self, first: int, length: int) -> None:
        self.name, self.first, self.length = f"shard{first}", first, length

    def __len__(self) -> int:
        return self.length

    def read(self, start: int = 0):
        return iter(range(self.first + start, self.first + self.length))


def epoch_batches(shards: list, streams: int, epoch: int) -> list[set[int]]:
    loader = StreamLoader(
        shards, streams=streams, global_batch_size=16, world_size=1, rank=0, micro_batch_size=16, seed=0,
        collate_fn=list, current_epoch=lambda: epoch,
    )  # fmt: skip
    return [set(batch) for batch in loader]


@pytest.mark.parametrize(
    ("lengths", "repeats"),
    [([8] * 8, True), ([16] * 4, True), ([4] * 16, False), ([5, 11, 8, 8, 8, 8, 8, 8], False)],
)
def test_streams_that_read_the_same_parts_every_epoch_are_found_and_warned_about(lengths, repeats):
    """As many equal shards as streams (one whole shard a stream), or half as many (half a shard a stream), give
    global batch k the same samples in every epoch (the loader shows it); same_batches_every_epoch says so exactly
    then, and setup warns with what to change. Two shards a stream, or shards of other lengths, mix other samples
    into batch k in the next epoch."""
    shards = [Numbered(sum(lengths[:i]), length) for i, length in enumerate(lengths)]
    batches = [epoch_batches(shards, 8, epoch) for epoch in (0, 1)]
    assert (batches[0] == batches[1]) is repeats
    assert same_batches_every_epoch(lengths, 8, 16, seed=0) is repeats

    class Data(StreamingDataModule):
        def train_shards(self):
            return shards

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Data(global_batch_size=16, streams=8).setup("fit")
    said = [str(w.message) for w in caught if "same samples in every epoch" in str(w.message)]
    assert len(said) == int(repeats)
    if repeats:
        fewer = f"--data.streams {len(lengths) // 2} or fewer"  # 2 shards a stream
        assert "global batch k holds the same samples in every epoch" in said[0] and fewer in said[0], said[0]
