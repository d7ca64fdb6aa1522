"""The GPU check for maintainers: what the CPU-only CI cannot run, on a machine with one or more GPUs.

    python .ci/gpu_check.py            # in an environment with the CUDA build of torch and requirements.txt

Bakes the project with the language-model example into a temporary directory and runs, printing one
`gpu_check:` line per step (PASS, FAIL or SKIP and the number that decided it):
1. the baked suite's GPU-marked tests (`pytest -m gpu`: NCCL parity in float64/float32/bf16, MFU, FSDP; those
   needing 2 GPUs skip on 1), then the library's (`tests/library`: the NCCL stop and hang paths);
2. 1 GPU vs 1 CPU process in float64 (the default model, 2 epochs): within the CPU parity bound, 1e-12;
3. on a single GPU, 2 ranks anyway: two one-process torchrun agents (`--trainer.num_nodes 2`) sharing the GPU
   over gloo, vs 1 GPU, in float64 (with 2+ GPUs step 1 compares 2 GPUs over NCCL);
4. a bf16-mixed fit on 1 GPU: 1 vs 2 devices' bf16 criterion needs 2 GPUs (step 1); here it must train;
5. the language-model example's MFU on 1 GPU (median of its logged windows).
Exits 1 when a step fails, 2 when no GPU is visible.
"""

import csv
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

TEMPLATE = Path(__file__).resolve().parents[1]
FP64 = ["--trainer.precision", "64-true", "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false"]
failed = []


def say(step: str, ok: bool | None, detail: str) -> None:
    print(f"gpu_check: {step}: {'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} {detail}", flush=True)
    if ok is False:
        failed.append(step)


def sh(cmd: list[str], cwd: Path, log: Path, timeout: float = 1800) -> int:
    """Run `cmd`, its output into `log`; the exit status (124 on timeout)."""
    with open(log, "w") as out:
        try:
            return subprocess.run(
                cmd, check=False, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return 124


def fit(project: Path, root: Path, *args: str) -> int:
    return sh(
        [sys.executable, "main.py", "fit", *args, "--trainer.default_root_dir", str(root)],
        project,
        root.with_suffix(".log"),
    )


def compare(project: Path, a: Path, b: Path, tol: float) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "ddpkit.parity", str(a), str(b), "--rel-tol", str(tol)]
    result = subprocess.run(cmd, check=False, cwd=project, capture_output=True, text=True)
    return result.returncode == 0, (result.stdout.strip().splitlines() or ["no output"])[-1]


def version(root: Path) -> Path:
    return root / "lightning_logs" / "version_0"


def main() -> int:
    gpus = torch.cuda.device_count()
    if not gpus:
        print("error: no CUDA GPU is visible: .ci/gpu_check.py runs what needs one; CI runs the rest", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    print(f"gpu_check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; runs and logs in {work}")
    bake = ["cookiecutter", "--no-input", "-o", str(work), str(TEMPLATE), "lm_example=yes"]
    subprocess.run(bake, check=True, capture_output=True)
    project = work / "ddp-digits"

    code = sh([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "tests"], project, work / "pytest-gpu.log")
    tail = (work / "pytest-gpu.log").read_text().strip().splitlines()[-1:] or ["no output"]
    say("GPU-marked tests", code == 0, tail[0])
    # The library's own GPU tests (NCCL stop and hang paths), from this repository.
    library = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "tests/library"]
    code = sh(library, TEMPLATE, work / "pytest-gpu-library.log")
    tail = (work / "pytest-gpu-library.log").read_text().strip().splitlines()[-1:] or ["no output"]
    say("the library's GPU-marked tests", code == 0, tail[0])

    gpu, cpu = work / "fp64-1gpu", work / "fp64-1cpu"
    codes = (
        fit(project, gpu, "--trainer.accelerator", "gpu", "--trainer.devices", "1", *FP64),
        fit(project, cpu, "--trainer.accelerator", "cpu", "--trainer.devices", "1", *FP64),
    )
    say(
        "float64 1 GPU vs CPU",
        *(compare(project, version(cpu), version(gpu), 1e-12) if codes == (0, 0) else (False, f"fits exited {codes}")),
    )

    if gpus == 1:
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        agents = work / "fp64-2agents"
        run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
        run += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{port}", "--rdzv_id", "gpu-check"]
        run += ["main.py", "fit", "--trainer.accelerator", "gpu", "--trainer.devices", "1", "--trainer.num_nodes", "2"]
        run += ["--trainer.strategy", "lightning.pytorch.strategies.DDPStrategy"]
        run += ["--trainer.strategy.process_group_backend", "gloo", *FP64, "--trainer.default_root_dir", str(agents)]
        logs = [open(work / f"agent{i}.log", "w") for i in range(2)]  # noqa: SIM115 (closed below)
        procs = [subprocess.Popen(run, cwd=project, stdout=log, stderr=subprocess.STDOUT) for log in logs]
        codes = tuple(p.wait(timeout=1800) for p in procs)
        for log in logs:
            log.close()
        ok = (
            compare(project, version(gpu), version(agents), 1e-12)
            if codes == (0, 0)
            else (False, f"agents exited {codes}")
        )
        say("2 ranks on 1 GPU (gloo) vs 1 GPU, float64", *ok)
    else:
        say("2 ranks on 1 GPU (gloo)", None, f"{gpus} GPUs: 2 GPUs over NCCL are compared by the GPU-marked tests")

    bf16 = work / "bf16-1gpu"
    code = fit(
        project,
        bf16,
        "--trainer.accelerator",
        "gpu",
        "--trainer.devices",
        "1",
        "--trainer.precision",
        "bf16-mixed",
        "--trainer.max_epochs",
        "2",
    )
    if code == 0:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(version(bf16))).Reload().Scalars("val/acc")[-1].value
        say("bf16-mixed fit on 1 GPU", True, f"val/acc {acc:.3f} after 2 epochs")
    else:
        say("bf16-mixed fit on 1 GPU", False, f"exited {code}, see {bf16.with_suffix('.log')}")

    lm = work / "lm-mfu"
    csv_logger = ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(lm)]
    code = fit(
        project, lm, "--config", "configs/lm.yaml", "--trainer.devices", "1", "--trainer.max_steps", "100", *csv_logger
    )
    rows = list(csv.DictReader(next(lm.rglob("metrics.csv")).read_text().splitlines())) if code == 0 else []
    mfu = [float(r["train/device/mfu"]) for r in rows if r.get("train/device/mfu")]
    if mfu:
        say(
            "LM example MFU, 1 GPU",
            0 < statistics.median(mfu) < 1,
            f"median {statistics.median(mfu):.3f} over {len(mfu)} windows",
        )
    else:
        say(
            "LM example MFU, 1 GPU",
            False if code else None,
            f"exit {code}; no MFU logged (peak FLOPs of this GPU unknown?)",
        )
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
