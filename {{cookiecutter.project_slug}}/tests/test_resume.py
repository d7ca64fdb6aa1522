"""Exact resume: stopped mid-epoch and resumed, on the same or another device count, a run ends as if never stopped."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import run_ok

CONFIG = """
trainer:
  precision: 64-true
  max_steps: STEPS
  logger: false
  enable_progress_bar: false
  callbacks:
    - class_path: {{ cookiecutter.package_name }}.ddp.checkpoints.CurrentModelCheckpoint
      init_args:
        dirpath: DIRPATH
        filename: "step{step}"
        every_n_train_steps: 1
        save_top_k: -1
        monitor: null  # this list entry is merged into config.yaml's ModelCheckpoint: undo its settings
        save_last: false
        auto_insert_metric_name: false
"""


def fit(root, devices: int, steps: int, *extra: str) -> None:
    """A float64 fit on CPU of `steps` steps that saves a checkpoint after every step into root/ckpts."""
    root.mkdir(parents=True, exist_ok=True)
    config = root / "steps.yaml"
    config.write_text(CONFIG.replace("STEPS", str(steps)).replace("DIRPATH", str(root / "ckpts")))
    args = ["fit", "--config", str(config), "--trainer.accelerator", "cpu", "--trainer.devices", str(devices)]
    run_ok(*args, "--trainer.default_root_dir", str(root), *extra, cwd=root, timeout=240)


def weights(path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def plan(global_batch) -> dict[str, int]:
    """1.5 epochs of the configured data; resume 2 -> 1 from 3/4 into epoch 0, 1 -> 2 from 1/4 into epoch 1."""
    n = global_batch["steps_per_epoch"]
    if n < 4:
        pytest.skip(f"mid-epoch resume needs at least 4 steps per epoch, the configured data gives {n}")
    return {"steps": n + n // 2, "two_to_one": 3 * n // 4, "one_to_two": n + n // 4}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, plan):
    """Uninterrupted 1- and 2-device runs, and each resumed from the other's mid-epoch checkpoint."""
    base, steps = tmp_path_factory.mktemp("resume"), plan["steps"]
    with ThreadPoolExecutor(2) as pool:  # two at a time: most of a small run is start-up
        list(pool.map(lambda job: fit(*job), [(base / "one", 1, steps), (base / "two", 2, steps)]))
        # 2 -> 1 mid epoch 0, crossing into epoch 1; 1 -> 2 mid epoch 1.
        resumes = [
            (base / "two_to_one", 1, steps, "--ckpt_path", str(base / f"two/ckpts/step{plan['two_to_one']}.ckpt")),
            (base / "one_to_two", 2, steps, "--ckpt_path", str(base / f"one/ckpts/step{plan['one_to_two']}.ckpt")),
        ]
        list(pool.map(lambda job: fit(*job), resumes))
    return base


def test_mid_epoch_checkpoint_records_loader_position(runs, plan):
    """The mid-epoch-0 checkpoint at step k holds the train loader's position: epoch 0, k global batches done."""
    k = plan["two_to_one"]
    ckpt = torch.load(runs / f"two/ckpts/step{k}.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "global_batches_done": k}]


@pytest.mark.parametrize(("resumed", "uninterrupted"), [("two_to_one", "two"), ("one_to_two", "one")])
def test_resumed_run_matches_uninterrupted(runs, plan, resumed, uninterrupted):
    """Resuming mid-epoch on another device count reaches the uninterrupted weights (float64, 1e-12)."""
    final = f"ckpts/step{plan['steps']}.ckpt"
    assert max_diff(weights(runs / resumed / final), weights(runs / uninterrupted / final)) < 1e-12
