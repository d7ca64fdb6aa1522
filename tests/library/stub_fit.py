"""A main.py that trains nothing, for the tests of how `python -m ddpkit.tune` schedules its trials (which values,
how many at once, on which devices, restarts): it speaks the worker's protocol as a trial's rank 0 does and starts
in ~0.1 s instead of the ~5 CPU-s of a Lightning fit. The trials that train for real are in test_tune.py's DDP
jobs.

- `fit ... ` with DDPKIT_TUNE_CHECK=PATH (the worker's check): writes the config the arguments make (every `--key
  value` nested, and a checkpoint callback monitoring val/loss, mode min) to PATH.
- `fit ...` as a trial: after every `samples` samples (default 1024), `validations` times (default 2), it sleeps
  `sleep` s (default 0), sends {step, samples, value} and reads the worker's answer; then writes last.ckpt and
  best-0.ckpt (the samples, as JSON) where Lightning would. value = base x 1024 / (1024 + samples): the same curve
  over samples for any batch, base from the values (|log10(x) + 2| per number, len/10 per text, batch sizes
  excluded). With `hold` set (a file name), a trial that resumes nothing sends nothing until that file exists in the
  working directory: a test keeps trials running for as long as it needs them. With `pause` set ({"trial": N,
  "until": file name}), trial N, resuming nothing, waits after its first checkpoint until that file exists: a test
  stops it there, however fast or slow the machine. A waiting trial whose worker is gone exits 1 (no orphan).
  `--ckpt_path` resumes at its samples. Its record (values, CUDA_VISIBLE_DEVICES, MASTER_PORT, OMP_NUM_THREADS,
  SLURM variables seen, start and end times, the checkpoint it resumed) goes to records/<pid>.json.
The settings are read from stub.json in the working directory (the worker's): a test sets no environment variable.
"""

import json
import math
import os
import sys
import time
from pathlib import Path

import yaml


def arguments(argv: list[str]) -> dict[str, str]:
    pairs = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--") and i + 1 < len(argv):
            pairs[arg[2:]] = argv[i + 1]
    return pairs


def nested(pairs: dict[str, str]) -> dict:
    """The config the pairs make; a key that others extend (`--model.optimizer SGD --model.optimizer.lr 0.1`) names
    a class: {class_path: SGD, lr: 0.1}."""
    config: dict = {}
    for key, value in pairs.items():
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        if any(other.startswith(key + ".") for other in pairs):
            node.setdefault(leaf, {})["class_path"] = yaml.safe_load(value)
        else:
            node[leaf] = yaml.safe_load(value)
    monitor = {"class_path": "ddpkit.run.checkpoints.CurrentModelCheckpoint", "init_args": {"monitor": "val/loss"}}
    config.setdefault("trainer", {})["callbacks"] = [monitor]
    return config


def base(values: dict) -> float:
    total = 1.0
    for key, value in values.items():
        if "batch_size" in key or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and value > 0:
            total += abs(math.log10(value) + 2)
        elif isinstance(value, str):
            total += len(value) / 10
    return total


def write(path: Path, record: dict) -> None:
    """Whole: a test may read it at any moment."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def wait_for_file(name: str, worker: int) -> bool:
    """Until `name` exists in the working directory (True), or the worker (this process's parent) is gone (False)."""
    while not Path(name).exists():
        if os.getppid() != worker:
            return False
        time.sleep(0.05)
    return True


def end(record: dict, path: Path) -> None:
    """The worker is gone: the record's end, and exit 1."""
    record["end"] = time.time()
    write(path, record)
    sys.exit(1)


def main() -> None:
    pairs = arguments(sys.argv[2:])
    if "DDPKIT_TUNE_CHECK" in os.environ:
        Path(os.environ["DDPKIT_TUNE_CHECK"]).write_text(yaml.safe_dump({"fit": nested(pairs)}))
        return
    settings = json.loads(Path("stub.json").read_text()) if Path("stub.json").is_file() else {}
    root = Path(pairs["trainer.default_root_dir"])
    owned = ("trainer.", "ckpt_path")
    values = {k: yaml.safe_load(v) for k, v in pairs.items() if not k.startswith(owned)}
    batch = int(values.get("data.init_args.global_batch_size", 64))
    every, count = settings.get("samples", 1024), settings.get("validations", 2)
    resumed = pairs.get("ckpt_path")
    done = json.loads(Path(resumed).read_text())["samples"] if resumed else 0
    record = {
        "root": str(root),
        "values": values,
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "port": os.environ.get("MASTER_PORT"),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "slurm": sorted(k for k in os.environ if k.startswith("SLURM_")),
        "resumed": resumed,
        "first_samples": done + every,
        "start": time.time(),
        "end": None,
    }
    out_path = Path("records") / f"{os.getpid()}.json"
    out_path.parent.mkdir(exist_ok=True)
    write(out_path, record)
    to_worker, from_worker = (int(fd) for fd in os.environ["DDPKIT_TUNE_CHANNEL"].split(","))
    out, inbox = os.fdopen(to_worker, "w"), os.fdopen(from_worker)
    checkpoints = root / "lightning_logs" / "version_0" / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    worker = os.getppid()
    pause = settings.get("pause") or {}
    paused = not resumed and root.name == f"trial_{pause.get('trial', -1):04d}"
    if settings.get("hold") and not resumed and not wait_for_file(settings["hold"], worker):
        end(record, out_path)
    for samples in range(done + every, count * every + 1, every):
        time.sleep(settings.get("sleep", 0))
        value = base(values) * 1024 / (1024 + samples)
        try:
            out.write(json.dumps({"step": samples // batch, "samples": samples, "value": value}) + "\n")
            out.flush()
            line = inbox.readline()
        except BrokenPipeError:
            line = ""
        if not line:  # the worker is gone
            end(record, out_path)
        for name in ("last.ckpt", "best-0.ckpt"):
            (checkpoints / name).write_text(json.dumps({"samples": samples}))
        if paused and not wait_for_file(pause["until"], worker):
            end(record, out_path)
        paused = False
        if json.loads(line)["stop"]:
            break
    record["end"] = time.time()
    write(out_path, record)


if __name__ == "__main__":
    main()
