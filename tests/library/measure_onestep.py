"""Measure one optimizer step from the same saved state on 1 and 2 devices against its rounding (not a test).

    python tests/library/measure_onestep.py MODEL DATA SEEDS... [-- main.py arguments]

For each seed: a float64 1-device fit that saves its state after global batches 1, n and n + 1 (n a epoch's), then
in float32 and in bf16-mixed the one-step replays (parity_probe.OneStep) of global batches 0, 1, n, n + 1 on 1
device, on 2 devices, on 1 device with every batch reversed and on 1 device with 2 micro-batches; prints per point
and tensor kind the ratios the one-step check's factor is set from (docs/measurements.md, "The one-step check").
"""

import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from procs import TESTS, finish, start

SIZES = ["--data.global_batch_size", "32", "--data.train_size", "128"]


def fit(root: Path, model: str, data: str, seed: int, devices: int, precision: str, extra: list[str]) -> Path:
    cmd = [sys.executable, "-m", "ddpkit.toy", "fit", "--model", model, "--data", data, *SIZES]
    cmd += ["--seed_everything", str(seed), "--trainer.devices", str(devices), "--trainer.accelerator", "cpu"]
    cmd += ["--trainer.precision", precision, "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false"]
    cmd += ["--doctor.enabled", "false", "--trainer.default_root_dir", str(root), *extra]
    result = finish(start(cmd, TESTS, {"OMP_NUM_THREADS": "1"}), timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:]
    return root


def main() -> None:
    args = sys.argv[1:]
    extra = args[args.index("--") + 1 :] if "--" in args else []
    args = args[: args.index("--")] if "--" in args else args
    model, data, seeds = args[0], args[1], [int(s) for s in args[2:]]
    base = Path(tempfile.mkdtemp(prefix=f"onestep-{model.split('.')[-1]}-"))
    n = 4  # 128 samples / 32
    rows = []
    for seed in seeds:
        saving = ["--trainer.callbacks+=ddpkit.testing.parity_probe.Probe", "--trainer.callbacks.resumable=true",
                  f"--trainer.callbacks.save_at_steps=[1,{n},{n + 1}]", *extra]  # fmt: skip
        states = fit(base / f"{seed}-fp64", model, data, seed, 1, "64-true", saving) / "probe"
        replay = ["--trainer.callbacks+=ddpkit.testing.parity_probe.OneStep", f"--trainer.callbacks.states={states}",
                  f"--trainer.callbacks.steps_per_epoch={n}", "--trainer.limit_val_batches", "0", *extra]  # fmt: skip
        jobs = {}
        for precision in ("32-true", "bf16-mixed"):
            for name, devices, more in (
                ("1", 1, []),
                ("2", 2, []),
                ("rev", 1, ["--trainer.callbacks+=ddpkit.testing.parity_probe.ReversedBatches"]),
            ):
                jobs[precision, name] = (base / f"{seed}-{precision}-{name}", devices, precision, [*replay, *more])
        with ThreadPoolExecutor(2) as pool:
            futures = {key: pool.submit(fit, r, model, data, seed, d, p, e) for key, (r, d, p, e) in jobs.items()}
        records = {key: torch.load(f.result() / "probe" / "onestep.pt", weights_only=False) for key, f in futures.items()}
        for precision in ("32-true", "bf16-mixed"):
            rec = {name: records[precision, name] for name in ("1", "2", "rev")}
            eps = torch.finfo(torch.bfloat16 if precision == "bf16-mixed" else torch.float32).eps
            for k in rec["1"]:
                for kind in ("grads", "update"):
                    for name in rec["1"][k]["after"] if kind == "update" else rec["1"][k]["grads"][0]:
                        def get(r):
                            p = rec[r][k]
                            if kind == "grads":
                                return p["grads"][0][name].double()
                            return (p["after"][name].double() - p["before"][name].double())
                        a = get("1")
                        if not a.is_floating_point() or a.numel() == 0:
                            continue
                        scale = a.abs().max().item()
                        d12, drev = ((a - get(r)).abs().max().item() for r in ("2", "rev"))
                        rows.append(dict(seed=seed, precision=precision, k=k, kind=kind, name=name, scale=scale,
                                         d12=d12, drev=drev, floor=eps * scale))  # fmt: skip
    out = base / "rows.json"
    out.write_text(json.dumps(rows))
    print(f"rows: {out}")


if __name__ == "__main__":
    main()
