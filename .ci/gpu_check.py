"""The GPU check for maintainers: what the CPU-only CI cannot run, on a machine with one or more GPUs.

    python .ci/gpu_check.py             # from this repository, on a GPU machine; 8 minutes on one GPU before lm-bench
    python .ci/gpu_check.py --dry-run   # anywhere: the same steps on CPU, small (tests/test_gpu_check.py runs it)

It needs what a baked project's `pip install -e ".[dev]"` installs (torch, Lightning, ddpkit, pytest, and cookiecutter
through cruft), nothing else: no optuna, MLflow or W&B. It bakes the project with the language-model example into
a work folder, prints torch's, CUDA's, the driver's, Lightning's and ddpkit's versions, then one `gpu_check:` line
per step: PASS, FAIL or SKIP, the figure that decided it, and the file beside it that holds the step's whole
output (a comparison's every tensor and tag, a pytest session, a fit's log). The steps (`STEPS`, in this order):
- the bake's GPU-marked tests (`pytest -m gpu`: NCCL parity in float64/float32/bf16, MFU, FSDP; those that need 2
  GPUs skip on 1), and the library's (`tests/library`, the files that hold a `gpu` mark: the NCCL stop and hang
  paths, a GPU fit that keeps no graph);
- float64, 1 GPU vs 1 CPU process (the default model, 2 epochs): within the CPU parity bound, 1e-12;
- float64, the same GPU fit again: bit-identical or not, which tells GPU nondeterminism from a DDP difference;
- on a single GPU, 2 ranks anyway: two one-process torchrun agents (`--trainer.num_nodes 2`) sharing the GPU over
  gloo, vs 1 GPU, in float64 (with 2+ GPUs the GPU-marked tests compare 2 GPUs over NCCL);
- a bf16-mixed fit on 1 GPU (1 vs 2 devices' bf16 criterion needs 2 GPUs: the GPU-marked tests); here it must train;
- the language-model example's MFU on 1 GPU (median of its logged windows);
- the scaling doctor's verdict and step time on a default (32-true, TF32) fit on 1 GPU;
- the benchmark (benchmarks/run.py, bf16-mixed, the realistic MLP, 2 rounds): template / bare Lightning and
  template / raw DDP step time;
- the language-model benchmark (benchmarks/lm.py, GPT-2 small, bf16-mixed, compiled, 1 round): template / hand-written
  DDP loop in tokens/s, and both sides' MFU;
- no GPU fit's log has torch's warning that an AccumulateGrad node was kept from an earlier step on another stream.
Steps that time something run alone, after the others (which run together). A step is a function decorated with
`@step`: adding one is writing one.

--dry-run runs the same steps on CPU, small, to keep this script from rotting where CI has no GPU: one float64 CPU fit
of 4 batches stands in for every 1-GPU fit (the comparisons, the bf16 and the doctor steps read it), the two agents
are CPU processes, MFU is skipped (no peak FLOPs on a CPU), the benchmarks run their small MLP and tiny GPT on CPU,
and the GPU-marked tests skip. `--skip` leaves steps out. Exits 1 when a step fails, 2 when no GPU is visible (without --dry-run) or an
argument is bad.
"""

import argparse
import csv
import importlib.metadata
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import redirect_stdout
from dataclasses import dataclass
from io import StringIO
from pathlib import Path

import torch

TEMPLATE = Path(__file__).resolve().parents[1]
NO_GPU = "no CUDA GPU is visible: .ci/gpu_check.py runs what needs one (--dry-run: its steps on CPU); CI runs the rest"
# torch's warning when a backward meets an AccumulateGrad node made on another stream (Lightning <= 2.6.6 built DDP
# on a side stream): a graph or node kept from an earlier step (tests/library/test_step_graph.py).
ACCUMULATE_GRAD_WARNING = "AccumulateGrad node's stream does not match"
# Lightning's advice to set the float32 matmul precision: the CLI's TF32 default sets it before Lightning looks.
TENSOR_CORE_ADVICE = "that has Tensor Cores"
FP64_TOL = 1e-12  # the CPU parity bound of float64 (the manual's parity.md)
# Held while this process's stdout is a comparison's (the parity tool prints) and while a step's line is printed.
STDOUT = threading.Lock()


@dataclass
class Result:
    ok: bool | None  # None: skipped
    detail: str
    output: str = ""  # the step's whole output, kept in its file


@dataclass(eq=False)  # hashable: results are kept by step
class Step:
    key: str  # the file of its output, and --skip's name for it
    name: str
    run: Callable[["Check"], Result]
    alone: bool  # times something: runs after the others, with nothing else running


STEPS: list[Step] = []


def step(key: str, name: str, alone: bool = False) -> Callable:
    """Register the decorated function (Check -> Result) as a step of the check, in definition order."""

    def register(run: Callable[["Check"], Result]) -> Callable[["Check"], Result]:
        STEPS.append(Step(key, name, run, alone))
        return run

    return register


class Check:
    """One run of the check: the work folder, the baked project, and the fits that several steps read (each made
    once, by whichever step asks first)."""

    def __init__(self, work: Path, dry_run: bool, gpus: int) -> None:
        self.work, self.dry_run, self.gpus = work, dry_run, gpus
        self.accelerator = "cpu" if dry_run else "gpu"
        self.project = work / "ddp-digits"
        self._fits: dict[str, Future] = {}
        self._lock = threading.Lock()

    def size(self) -> list[str]:
        """What a fit trains: 2 epochs of the default model; in a dry run 1 epoch of 4 batches."""
        if self.dry_run:
            return ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches",
                    "2", "--trainer.log_every_n_steps", "2"]  # fmt: skip
        return ["--trainer.max_epochs", "2"]

    def fit(self, name: str, *args: str) -> "Fit":
        """`python main.py fit ARGS` in the project, its log in WORK/NAME.log; once per name."""
        with self._lock:
            if name not in self._fits:
                self._fits[name] = Future()
                mine = True
            else:
                mine = False
        if mine:
            root = self.work / name
            cmd = [sys.executable, "main.py", "fit", *args, "--trainer.enable_progress_bar", "false"]
            cmd += ["--trainer.default_root_dir", str(root)]
            try:
                self._fits[name].set_result(Fit(root, sh(cmd, self.project, root.with_suffix(".log"))))
            except BaseException as error:  # the other steps waiting for this fit fail with it, not hang
                self._fits[name].set_exception(error)
        return self._fits[name].result()

    def fp64_gpu(self) -> "Fit":
        """The float64 fit on 1 GPU that the float64 steps compare; in a dry run the CPU one."""
        if self.dry_run:
            return self.fp64_cpu()
        return self.fit("fp64-1gpu", "--trainer.accelerator", "gpu", "--trainer.devices", "1", *self.fp64())

    def fp64_cpu(self) -> "Fit":
        return self.fit("fp64-1cpu", "--trainer.accelerator", "cpu", "--trainer.devices", "1", *self.fp64())

    def fp64(self) -> list[str]:
        return ["--trainer.precision", "64-true", *self.size()]

    def compare(self, a: "Fit", b: "Fit", tol: float) -> Result:
        """`python -m ddpkit.parity A B --rel-tol TOL` (in this process): its verdict and worst tensor or tag."""
        if a.code or b.code:
            return Result(False, f"fits exited {a.code}, {b.code}: see {a.log}, {b.log}")
        from ddpkit.parity import main as parity

        out = StringIO()
        with STDOUT, redirect_stdout(out):
            try:
                code = parity([str(a.run), str(b.run), "--rel-tol", str(tol)])
            except Exception as error:  # a missing checkpoint, different tags: the tool's own message
                print(f"error: {type(error).__name__}: {error}")
                code = 1
        text = out.getvalue()
        return Result(code == 0, summary(text), text)


@dataclass
class Fit:
    root: Path  # --trainer.default_root_dir
    code: int

    @property
    def log(self) -> Path:
        return self.root.with_suffix(".log")

    @property
    def run(self) -> Path:
        """The run's log directory (lightning_logs/version_0)."""
        return self.root / "lightning_logs" / "version_0"


def sh(cmd: list[str], cwd: Path, log: Path, timeout: float = 420) -> int:
    """Run `cmd`, its output into `log`; the exit status (124 on timeout, after killing its process group)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # every rank it started
            proc.wait()
            out.write(f"\ngpu_check: killed after {timeout} s\n")
            return 124


DIFF = re.compile(r"^\s+(?P<name>\S.*?): max_abs (?P<abs>\S+), max_rel (?P<rel>[^\s(]+)", re.MULTILINE)


def summary(parity_output: str) -> str:
    """The parity tool's verdict line and the tensor or tag with the largest max_rel among those it lists."""
    lines = parity_output.strip().splitlines()
    verdict = next((line for line in reversed(lines) if line.startswith(("PASS", "FAIL", "error"))), "no verdict")
    diffs = [(float(m["rel"]), m["name"], m["abs"]) for m in DIFF.finditer(parity_output)]
    if not diffs:
        return verdict
    rel, name, abs_ = max(diffs, key=lambda d: (d[0] != d[0], d[0]))  # NaN first
    return f"{verdict}; worst: {name}, max_abs {abs_}, max_rel {rel:.3g}"


def worst_rel(parity_output: str) -> float | None:
    """The verdict line's worst max_rel."""
    found = re.search(r"worst max_rel (\S+)", parity_output)
    return float(found[1]) if found else None


def pytest_tail(log: Path) -> str:
    lines = log.read_text().strip().splitlines()
    return lines[-1] if lines else "no output"


# --- the steps -----------------------------------------------------------------------------------------------------


@step("bake-tests", "the bake's GPU-marked tests")
def bake_tests(check: Check) -> Result:
    log = check.work / "bake-tests.log"
    code = sh([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "tests"],
              check.project, log, timeout=600)  # fmt: skip
    return Result(code == 0, pytest_tail(log), log.read_text())


def library_gpu_files() -> list[str]:
    """The library's test files that hold a GPU-marked test: only they are collected, so that the others' optional
    libraries (optuna, MLflow, W&B) need not be installed."""
    files = sorted((TEMPLATE / "tests" / "library").glob("test_*.py"))
    return [str(f.relative_to(TEMPLATE)) for f in files if "pytest.mark.gpu" in f.read_text()]


@step("library-tests", "the library's GPU-marked tests")
def library_tests(check: Check) -> Result:
    log = check.work / "library-tests.log"
    files = library_gpu_files()
    code = sh([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", *files],
              TEMPLATE, log, timeout=600)  # fmt: skip
    return Result(code == 0, f"{pytest_tail(log)} ({', '.join(Path(f).name for f in files)})", log.read_text())


@step("fp64-gpu-vs-cpu", "float64, 1 GPU vs 1 CPU process")
def fp64_gpu_vs_cpu(check: Check) -> Result:
    return check.compare(check.fp64_cpu(), check.fp64_gpu(), FP64_TOL)


@step("fp64-again", "float64, the same fit again on the GPU")
def fp64_again(check: Check) -> Result:
    if check.dry_run:
        again = check.fp64_cpu()
    else:
        again = check.fit("fp64-1gpu-again", "--trainer.accelerator", "gpu", "--trainer.devices", "1", *check.fp64())
    result = check.compare(check.fp64_gpu(), again, FP64_TOL)
    rel = worst_rel(result.output)
    if rel == 0.0:
        result.detail = f"bit-identical; {result.detail}"
    elif rel is not None:  # nondeterminism of this size is in every GPU comparison too
        result.detail = f"NOT bit-identical: the GPU itself varies run to run; {result.detail}"
    return result


@step("fp64-2-ranks", "float64, 2 ranks on 1 GPU (gloo) vs 1 GPU")
def fp64_two_ranks(check: Check) -> Result:
    if check.gpus > 1:
        return Result(None, f"{check.gpus} GPUs: the GPU-marked tests compare 2 GPUs over NCCL")
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    root = check.work / "fp64-2agents"
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
    run += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{port}", "--rdzv_id", "gpu-check"]
    run += ["main.py", "fit", "--trainer.accelerator", check.accelerator, "--trainer.devices", "1"]
    run += ["--trainer.num_nodes", "2", "--trainer.strategy", "ddpkit.run.strategy.TimedDDPStrategy"]
    run += ["--trainer.strategy.process_group_backend", "gloo", *check.fp64(), "--trainer.enable_progress_bar", "false"]
    run += ["--trainer.default_root_dir", str(root)]
    with ThreadPoolExecutor(2) as pool:  # the two agents at once: they meet at the rendezvous
        codes = list(pool.map(lambda i: sh(run, check.project, check.work / f"fp64-2agents-{i}.log"), range(2)))
    agents = Fit(root, max(codes, key=abs))
    root.with_suffix(".log").write_text("".join((check.work / f"fp64-2agents-{i}.log").read_text() for i in range(2)))
    return check.compare(check.fp64_gpu(), agents, FP64_TOL)


@step("bf16", "a bf16-mixed fit on 1 GPU")
def bf16(check: Check) -> Result:
    if check.dry_run:  # its CPU fit stands in
        fit = check.fp64_cpu()
    else:
        fit = check.fit("bf16-1gpu", "--trainer.accelerator", "gpu", "--trainer.devices", "1",
                        "--trainer.precision", "bf16-mixed", *check.size())  # fmt: skip
    if fit.code:
        return Result(False, f"exited {fit.code}, see {fit.log}", fit.log.read_text())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(fit.run)).Reload().Scalars("val/acc")
    text = "\n".join(f"step {e.step}: val/acc {e.value}" for e in acc)
    # It must learn: 2 epochs in float32 reach 0.9; 4 batches (a dry run) only have to beat chance (0.1).
    floor, trained = (0.1, "4 batches") if check.dry_run else (0.5, "2 epochs")
    return Result(acc[-1].value > floor, f"val/acc {acc[-1].value:.3f} after {trained} (floor {floor})", text)


@step("lm-mfu", "the language-model example's MFU on 1 GPU")
def lm_mfu(check: Check) -> Result:
    if check.dry_run:
        return Result(None, "no MFU on a CPU (no peak FLOPs)")
    root = check.work / "lm-mfu"
    csv_logger = ["--trainer.logger+=lightning.pytorch.loggers.CSVLogger"]
    fit = check.fit("lm-mfu", "--config", "configs/lm.yaml", "--trainer.accelerator", "gpu", "--trainer.devices", "1",
                    "--trainer.max_steps", "100", *csv_logger)  # fmt: skip
    rows = list(csv.DictReader(next(root.rglob("metrics.csv")).read_text().splitlines())) if not fit.code else []
    mfu = [float(r["train/device/mfu"]) for r in rows if r.get("train/device/mfu")]
    if not mfu:
        return Result(False, f"exit {fit.code}; no MFU logged (peak FLOPs of this GPU unknown?)", fit.log.read_text())
    median = statistics.median(mfu)
    return Result(0 < median < 1, f"median {median:.3f} over {len(mfu)} windows", "\n".join(map(str, mfu)))


@step("doctor", "the scaling doctor on a default fit on 1 GPU", alone=True)
def doctor(check: Check) -> Result:
    from ddpkit.scaling.record import DoctorRecord

    if check.dry_run:  # its CPU fit: the doctor is on in every fit
        fit = check.fp64_cpu()
    else:
        fit = check.fit("doctor-1gpu", "--trainer.accelerator", "gpu", "--trainer.devices", "1", *check.size())
    report = fit.run / "doctor.json"
    if fit.code or not report.is_file():
        return Result(False, f"exit {fit.code}, {'no ' if not report.is_file() else ''}{report}", fit.log.read_text())
    record = DoctorRecord.from_dict(json.loads(report.read_text()), str(report))
    log = fit.log.read_text()
    detail = f"verdict {record.verdict}, step {record.step_ms:.2f} ms, {record.samples_per_s:.0f} samples/s"
    if TENSOR_CORE_ADVICE in log:  # printed only on GPUs with TF32, when the precision is still "highest"
        return Result(False, f"{detail}; Lightning still advises setting the matmul precision", log)
    return Result(record.step_ms > 0, detail, report.read_text())


@step("benchmark", "the benchmark: template / bare Lightning, template / raw DDP", alone=True)
def benchmark(check: Check) -> Result:
    out, log = check.work / "benchmark.json", check.work / "benchmark.log"
    if check.dry_run:
        size = ["--accelerator", "cpu", "--configs", "small", "--repeats", "1", "--epochs", "2"]
    else:
        size = ["--accelerator", "gpu", "--precision", "bf16-mixed", "--configs", "realistic", "--repeats", "2"]
    cmd = [sys.executable, str(TEMPLATE / "benchmarks" / "run.py"), *size, "--procs", "1"]
    code = sh([*cmd, "--project", str(check.project), "--json", str(out)], TEMPLATE, log, timeout=600)
    if code:
        return Result(False, f"exited {code}, see {log}", log.read_text())
    (row,) = json.loads(out.read_text())["rows"]
    steps = " / ".join(f"{row[f'{side}_step_ms']['median']:.2f}" for side in ("raw", "bare", "template"))
    detail = (
        f"template / bare Lightning {row['template_vs_bare']['median']:.3f}, template / raw {row['ratio']['median']:.3f}"
        f" (ms/step raw / bare / template: {steps}; max weight diff {row['weight_diff']:.1e})"
    )
    return Result(True, detail, log.read_text())


@step("lm-bench", "the language-model benchmark: template / hand-written loop, tokens/s and MFU", alone=True)
def lm_bench(check: Check) -> Result:
    log = check.work / "lm-bench.log"
    if check.dry_run:  # the tiny GPT on CPU, 2 steps an epoch: that the script and its parsing still work
        size = ["--accelerator", "cpu", "--steps", "2", "--epochs", "2"]
    else:  # GPT-2 small, bf16-mixed, compiled; one round keeps the check short (benchmarks/lm.py runs 3 by default)
        size = ["--accelerator", "gpu"]
    cmd = [sys.executable, str(TEMPLATE / "benchmarks" / "lm.py"), *size, "--rounds", "1"]
    code = sh([*cmd, "--project", str(check.project)], TEMPLATE, log, timeout=900)
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("lm-bench: device=")]
    if code or not lines:
        return Result(False, f"exited {code}, see {log}", text)
    fields = dict(pair.split("=", 1) for pair in lines[-1].removeprefix("lm-bench: ").split())
    detail = (
        f"{fields['size']} ({fields['params']} parameters): template / raw tokens/s {fields['ratio']} "
        f"({fields['template_tokens_per_s']} / {fields['raw_tokens_per_s']}), MFU template {fields['template_mfu']}, "
        f"raw {fields['raw_mfu']}; max weight diff {fields['max_weight_diff']}"
    )
    return Result(float(fields["ratio"]) > 0, detail, text)


@step("accumulate-grad", "no GPU fit warns of an AccumulateGrad node kept from an earlier step")
def accumulate_grad(check: Check) -> Result:
    logs = sorted(check.work.glob("*.log"))
    warned = [log.name for log in logs if ACCUMULATE_GRAD_WARNING in log.read_text(errors="replace")]
    listing = "\n".join(f"{log.name}: {'WARNED' if log.name in warned else 'clean'}" for log in logs)
    if warned:
        return Result(False, f"torch's AccumulateGrad stream warning in {', '.join(warned)}", listing)
    return Result(True, f"none in {len(logs)} logs", listing)


# --- running them --------------------------------------------------------------------------------------------------


def versions(gpus: int) -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = "unknown (no nvidia-smi)"
    import ddpkit

    device = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "no GPU (dry run)"
    return (
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, driver {driver}, "
        f"Lightning {importlib.metadata.version('lightning')}, ddpkit {ddpkit.__version__} "
        f"({Path(ddpkit.__file__).parent}); {device}"
    )


def run_step(check: Check, s: Step) -> Result:
    started = time.monotonic()
    try:
        result = s.run(check)
    except Exception as error:  # one broken step must not hide the others' results
        result = Result(False, f"{type(error).__name__}: {error}")
    output = check.work / f"{s.key}.txt"
    output.write_text(result.output)
    verdict = "SKIP" if result.ok is None else "PASS" if result.ok else "FAIL"
    with STDOUT:
        print(
            f"gpu_check: {s.name}: {verdict} {result.detail} [{time.monotonic() - started:.0f} s] ({output})",
            flush=True,
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="the steps on CPU, small: no GPU needed")
    parser.add_argument("--work", type=Path, help="folder for the bake, the runs and the outputs (default: a new one)")
    keys = [s.key for s in STEPS]
    parser.add_argument("--skip", default="", help=f"comma-separated steps to leave out, of: {', '.join(keys)}")
    args = parser.parse_args(argv)
    skip = [k for k in args.skip.split(",") if k]
    if unknown := [k for k in skip if k not in keys]:
        parser.error(f"unknown step {', '.join(unknown)}: the steps are {', '.join(keys)}")
    gpus = torch.cuda.device_count()
    if not gpus and not args.dry_run:
        print(f"error: {NO_GPU}", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"gpu_check: {versions(gpus)}; runs and outputs in {work}", flush=True)
    bake = [sys.executable, "-m", "cookiecutter", "--no-input", "-o", str(work), str(TEMPLATE), "lm_example=yes"]
    baked = subprocess.run(bake, capture_output=True, text=True, check=False, timeout=300)
    if baked.returncode:
        print(f"error: the bake failed: {baked.stdout[-2000:]}{baked.stderr[-2000:]}", file=sys.stderr)
        return 1
    check = Check(work, args.dry_run, gpus)
    chosen = [s for s in STEPS if s.key not in skip]
    last = [s for s in chosen if s.key == "accumulate-grad"]  # reads the logs of every fit before it
    together = [s for s in chosen if not s.alone and s not in last]
    with ThreadPoolExecutor(2 if args.dry_run else 6) as pool:
        results = dict(zip(together, pool.map(lambda s: run_step(check, s), together), strict=True))
    for s in [s for s in chosen if s.alone and s not in last] + last:
        results[s] = run_step(check, s)
    failed = [s.name for s, result in results.items() if result.ok is False]
    outcome = f"FAILED: {'; '.join(failed)}" if failed else "all steps passed"
    print(f"gpu_check: {outcome} in {time.monotonic() - started:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
