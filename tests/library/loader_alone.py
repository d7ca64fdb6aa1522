"""The training loader of the configured data module iterated alone, outside any training: the independent
measurement the doctor's data part is checked against on your model (tests/test_doctor_numbers.py).

    python tests/loader_alone.py DEVICES EPOCHS [main.py arguments]

Builds model, data and trainer as `main.py fit --trainer.devices DEVICES` does, without launching ranks,
and iterates rank 0's training loader for an epoch to warm up, then EPOCHS epochs, timing iterator
creation and every `next()`, as the doctor's data wait sees them, less the time this thread waited for a
CPU (which the doctor leaves out of the data part too). Prints one JSON line:
{"ms_per_batch": ..., "batches": ...}.
"""

import json
import sys
import time
from pathlib import Path

from alone import waited_s

PROJECT = Path(__file__).resolve().parents[1]


def main(devices: int, epochs: int, args: list[str]) -> None:
    sys.path.insert(0, str(PROJECT))
    from main import main as build

    cpu = ["--trainer.logger", "false", "--trainer.accelerator", "cpu", "--trainer.devices", str(devices)]
    cli = build([*args, *cpu], run=False)
    data = cli.datamodule
    data.trainer = cli.trainer  # as fit attaches it: the per-device batch and rank 0's shard follow from it
    data.setup("fit")
    loader = data.train_dataloader()
    seconds, batches = 0.0, 0
    for epoch in range(1 + epochs):
        start, waited = time.perf_counter(), waited_s()
        count = sum(1 for _ in loader)
        if epoch:  # the first epoch warms up (file cache, worker start-up)
            seconds += time.perf_counter() - start - (waited_s() - waited)
            batches += count
    print(json.dumps({"ms_per_batch": 1000 * seconds / max(batches, 1), "batches": batches}))


if __name__ == "__main__":
    devices, epochs, rest = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    sys.argv = sys.argv[:1]  # LightningCLI reads sys.argv too when given args
    main(devices, epochs, rest)
