"""A default bake on given releases of torch, Lightning & co.: installed first into a new environment, then the
project's `pip install -e ".[dev]"`, which must keep them; then the project's own `pytest` and the library's unit
tests there. tests/test_oldest.py runs it on the oldest releases ddpkit supports (tests/oldest.txt) in CI; a
maintainer runs it on a new release of torch or Lightning the day it appears, the rest of the set as the
project's constraints.txt pins it:

    python tests/releases.py torch==2.15.0        # or lightning==2.7.0 (with constraints.txt's torch), or both
    python tests/releases.py --no-constraints torch==2.11.0   # a GPU image's torch: pip chooses the rest

It prints each step's time, the summaries and whether the releases were kept, and exits 0 when all passed; the
result goes into docs/measurements.md. Then constraints.txt moves to the new release (or ddpkit's range excludes
it, with the reason), so that the newest releases are tested when they appear rather than refused
(vendor/ddpkit/docs/versions.md).
"""

import shutil
import sys
import tempfile
import time
from pathlib import Path

from bakes import TEMPLATE, bake, fresh_env, pinned_versions, run, torch_pin

CONSTRAINTS = TEMPLATE / "{{cookiecutter.project_slug}}" / "constraints.txt"
# The library's unit tests that need nothing but the library and pytest (the others need this repository's
# requirements: the trackers, the adapters, the template's own helpers).
UNITS = [
    "test_lightning_internals.py",
    "test_private_names.py",
    "test_suite_units.py",
    "test_sampling.py",
    "test_schedules.py",
    "test_diagnosis.py",
    "test_doctor_steps.py",
    "test_presets.py",
]
INSTALLS = ("torch", "releases", "project")
NEWEST_SHOWN = ("lightning", "torchmetrics", "tensorboard", "jsonargparse", "pyyaml")


def download(releases: list[str], wheels: Path) -> None:
    """Download torch's release of `releases` with everything it needs into `wheels` (pip download, this machine's
    pip configuration): what the story's `pip install` of it would fetch, fetched ahead (a CUDA build is 2.74 GB)."""
    torch = next(r for r in releases if r.lower().startswith("torch=="))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--dest", str(wheels), torch]
    result = run(cmd, None, timeout=1800)
    assert result.returncode == 0, f"{' '.join(cmd)}: {result.stdout[-3000:]}"


def story(base: Path, releases: list[str], constraints: Path | None = None, wheels: Path | None = None) -> dict:
    """Bake into `base`; in a new environment install `releases` (requirement lines, torch's first and alone: no
    other torch is ever downloaded; from the folder `wheels` alone where given: see `download`), then the project
    (`-c constraints` where given); run its pytest, then the units. {step: (status, output, seconds)}; the steps after
    a failed install are left out. The two ran at once for a day: in the second CI run that did it, on torch 2.4.0,
    the units hung in `destroy_process_group` (gloo's destructor joining a thread, 900 s and counting, nothing else
    running; 2026-12-06), where run one after the other they had passed in every CI run since 2026-12-04."""
    project = bake(base)
    env = {**fresh_env(base / "venv"), "COLUMNS": "300"}
    pip = ["python", "-m", "pip", "install", "-q"]
    torch = next(r for r in releases if r.lower().startswith("torch=="))
    local = ["--no-index", "--find-links", str(wheels)] if wheels else []
    listed = base / "releases.txt"
    listed.write_text("\n".join(releases) + "\n")
    steps = (
        ("torch", [*pip, *local, torch]),
        ("releases", [*pip, "-r", str(listed)]),
        ("project", [*pip, "-e", ".[dev]", *(["-c", str(constraints)] if constraints else [])]),
        ("versions", ["python", "-m", "pip", "list", "--format=freeze"]),
        ("pytest", ["python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]),
        (
            "units",
            ["python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--confcutdir",
             str(TEMPLATE / "tests" / "library"), *(str(TEMPLATE / "tests" / "library" / u) for u in UNITS)],
        ),
    )  # fmt: skip

    record = {}
    try:
        for name, cmd in steps:
            began = time.monotonic()
            code, out = run_step(name, cmd, project, env)
            record[name] = (code, out, time.monotonic() - began)
            if code and name in INSTALLS:
                break
    finally:  # the record holds what the tests read; a CUDA torch's environment is 5 GB that pytest would keep
        shutil.rmtree(base / "venv", ignore_errors=True)
    return record


# A process that a test waits for and kills after its timeout (procs.finish, ddpkit.testing.helpers).
TIMED_OUT = "timed out after"
# On torch 2.4.0, a 2-process gloo run that had trained, validated and printed its doctor's report never exited, in the
# CLI's destroy_process_group (gloo's destructor holds the GIL while it joins its threads; torch released it there from
# 2.8: pytorch/pytorch#154976): the oldest job's units in the CI runs of 2026-12-06 (the micro-batched doctor fixture)
# and once before with the units beside the project's pytest. Not this project's code, and not seen on torch 2.13.
RAN_AGAIN = "ran again: a process timed out in the first try (on torch 2.4, a hang at exit: tests/releases.py)"


def run_step(name: str, cmd: list[str], cwd: Path, env: dict, timeout: float = 1800) -> tuple[int, str]:
    """A story's step: its exit code and output. A test step that failed on a process timing out runs once more
    (RAN_AGAIN): the first try's failures head the output, the second's summary is its last line."""
    result = run(cmd, cwd, timeout=timeout, env=env)
    if not result.returncode or name in INSTALLS or TIMED_OUT not in result.stdout:
        return result.returncode, result.stdout
    failed = "\n".join(line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR")))
    again = run(cmd, cwd, timeout=timeout, env=env)
    return again.returncode, f"{RAN_AGAIN}\n{failed}\n{again.stdout}"


def installed(record: dict) -> dict[str, str]:
    """{name (lower case): version without a local label} from the story's `pip list`."""
    lines = record["versions"][1].split()
    return {n.lower(): v.split("+")[0] for n, v in (line.split("==") for line in lines if "==" in line)}


def kept(record: dict, releases: list[str]) -> list[str]:
    """The releases that the environment does not hold at the end, as "name: wanted, found"."""
    have = installed(record)
    wanted = {name.split("[")[0].lower(): version for name, version in (r.split("==") for r in releases)}
    return [f"{name}: {version} wanted, {have.get(name)} found" for name, version in wanted.items()
            if have.get(name) != version]  # fmt: skip


def with_releases(releases: list[str], folder: Path) -> Path:
    """constraints.txt with the named packages at the given releases instead (a file in `folder`)."""
    names = {r.split("==")[0].split("[")[0].lower() for r in releases}
    rest = {n: v for n, v in pinned_versions(CONSTRAINTS).items() if n.split("[")[0].lower() not in names}
    path = folder / "constraints.txt"
    path.write_text("".join(f"{n}=={v}\n" for n, v in rest.items()) + "".join(f"{r}\n" for r in releases))
    return path


def main(args: list[str]) -> int:
    bare = "--no-constraints" in args  # as on a GPU image: the project's install picks the rest itself
    releases = [a for a in args if a != "--no-constraints"]
    if not releases or any("==" not in r for r in releases):
        print("error: name the releases as NAME==VERSION, e.g. torch==2.15.0 or lightning==2.7.0", file=sys.stderr)
        return 2
    if not any(r.lower().startswith("torch==") for r in releases):
        releases = [torch_pin(), *releases]  # the newest tested torch, first
    with tempfile.TemporaryDirectory(prefix="releases-") as folder:
        base = Path(folder)
        record = story(base, releases, None if bare else with_releases(releases, base))
        for name, (code, out, seconds) in record.items():
            print(f"{name:9} {'ok' if code == 0 else f'FAILED ({code})':12} {seconds:6.0f} s")
            if code or name in ("pytest", "units"):
                print("    " + "\n    ".join(out.strip().splitlines()[-(40 if code else 1) :]))
        missing = kept(record, releases) if "versions" in record else ["(not installed)"]
        if "versions" in record:
            have = installed(record)
            print("installed: " + ", ".join(f"{n} {have.get(n)}" for n in ("torch", *NEWEST_SHOWN)))
        print("kept: " + ("all of " + ", ".join(releases) if not missing else "NO: " + "; ".join(missing)))
        return 0 if not missing and all(code == 0 for code, _, _ in record.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
