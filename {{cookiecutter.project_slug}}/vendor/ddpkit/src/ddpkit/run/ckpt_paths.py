"""What `--ckpt_path last`, `best` and `auto` stand for: a checkpoint file under `--trainer.default_root_dir`, found
right after parsing (`cli.CLI` calls `resolve_ckpt_path`), and the run directory that a `fit` from it continues.

Lightning looks for `last` only in the new run's own directory; here nothing found is an `error:` line
(`checks.BadInput`), never a silent fresh start.
"""

import os
import sys
import zipfile
from pathlib import Path
from typing import Any

from ..scaling.sweeper import SWEEP_MARKER
from .checks import BadInput, load_lazily
from .processes import rank_label

# Not searched for last.ckpt: environments, caches, version control.
SKIP_DIRS = {"site-packages", "__pycache__", "node_modules"}


def resolve_ckpt_path(config: Any, subcommand: str) -> Path | None:
    """Turn `--ckpt_path last` and `auto` (and `best` for validate/test/predict) into a file; return the run
    directory that `fit` continues, else None.

    Lightning looks for `last` only in the new run's own directory, so after a finished or crashed run it
    warns and trains from scratch. Here `last` is the newest complete `last.ckpt` under
    `--trainer.default_root_dir`, and nothing found is an error, never a silent fresh start. `fit --ckpt_path
    auto` is the command for a job that a scheduler starts and restarts: the newest complete `last.ckpt` under
    the root, or a SLURM requeue's `hpc_ckpt_N.ckpt` in the root itself when it is as far (`further`), else a
    new run.
    """
    ckpt_path = config.get("ckpt_path")
    if ckpt_path not in ("last", "best", "auto"):
        return None
    if ckpt_path == "best" and subcommand == "fit":
        raise BadInput("--ckpt_path best is for validate, test and predict; resume training with --ckpt_path last.")
    if ckpt_path == "auto" and subcommand != "fit":
        raise BadInput(f"--ckpt_path auto is for fit (a job that may restart); {subcommand} takes last or best.")
    root = Path((config.get("trainer") or {}).get("default_root_dir") or os.getcwd())
    last = newest_last_checkpoint(root)
    if ckpt_path == "auto":
        last = further(last, newest_hpc_checkpoint(root))
        if last is None:
            config["ckpt_path"] = None
            if rank_label() == "0":
                sys.stderr.write(f"fit: --ckpt_path auto: no complete checkpoint under {root}; starting a new run\n")
            return None
    if last is None:
        raise BadInput(
            f"--ckpt_path {ckpt_path}: no complete last.ckpt under {root}. Train first (python main.py fit), "
            "point --trainer.default_root_dir at the run's root, or pass a checkpoint file."
        )
    path = best_checkpoint(last) if ckpt_path == "best" else last
    config["ckpt_path"] = str(path)
    if rank_label() == "0":
        sys.stderr.write(f"{subcommand}: --ckpt_path {ckpt_path} is {path}\n")
    run = last.parent.parent
    return run if subcommand == "fit" and last.name == "last.ckpt" and last.parent.name == "checkpoints" else None


def further(last: Path | None, hpc: Path | None) -> Path | None:
    """Of the newest last.ckpt and a SLURM requeue's hpc_ckpt_N.ckpt, the one further in training; on a tie the
    requeue's: it is saved mid-epoch with the loader's position, then the job stops and Lightning ends the epoch
    with a last.ckpt of the same step that counts the epoch as done (a resume from it skipped the epoch's rest)."""
    if last is None or hpc is None:
        return last or hpc
    if last.is_dir() or hpc.is_dir():  # a sharded checkpoint keeps its step in the shards: the newer one
        return max(last, hpc, key=lambda c: (c / ".metadata" if c.is_dir() else c).stat().st_mtime)
    steps = [load_lazily(str(c)).get("global_step", -1) for c in (last, hpc)]
    return hpc if steps[1] >= steps[0] else last


def newest_hpc_checkpoint(root: Path) -> Path | None:
    """The highest `hpc_ckpt_N.ckpt` in `root` that is complete: SlurmRequeue's (and Lightning's) save before a
    requeue, mid-epoch, which Lightning itself resumes only when no `--ckpt_path` is given."""
    numbered = [(int(p.stem[9:]), p) for p in root.glob("hpc_ckpt_*.ckpt") if p.stem[9:].isdigit()]
    complete = [(n, p) for n, p in numbered if zipfile.is_zipfile(p) or (p / ".metadata").is_file()]
    return max(complete)[1] if complete else None


def newest_last_checkpoint(root: Path) -> Path | None:
    """The most recently written complete `last.ckpt` under `root`: a file that is a whole zip archive (the
    format torch.save writes; a torn write lacks its end), or a sharded checkpoint's directory with its index.
    A sweep's or a study's folder below `root` (marked SWEEP_MARKER by ddpkit.scaling and ddpkit.tune) is skipped: its
    runs are newer than the training, and shorter."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if SWEEP_MARKER in filenames and Path(dirpath) != Path(root):
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS]
        path = Path(dirpath) / "last.ckpt"
        if "last.ckpt" in filenames and zipfile.is_zipfile(path):
            found.append((path.stat().st_mtime, path))
        elif "last.ckpt" in dirnames and (path / ".metadata").is_file():
            found.append(((path / ".metadata").stat().st_mtime, path))
    return max(found)[1] if found else None


def best_checkpoint(last: Path) -> Path:
    """The best checkpoint recorded by the checkpoint callback in `last` (its state travels in every save)."""
    if last.is_dir():
        raise BadInput(f"--ckpt_path best: {last} is a sharded checkpoint; pass the best one's directory instead.")
    states = load_lazily(str(last)).get("callbacks") or {}
    best = [s["best_model_path"] for s in states.values() if isinstance(s, dict) and s.get("best_model_path")]
    if not best or not Path(best[0]).exists():
        raise BadInput(f"--ckpt_path best: {last} records no best checkpoint that still exists; pass a file.")
    return Path(best[0])
