"""Baking the template, for the template's tests (a module of its own: tests/library has a conftest too, so
`from conftest import ...` would be ambiguous)."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import yaml

TEMPLATE = Path(__file__).resolve().parents[1]
WORKFLOW = ".github/workflows/tests.yml"


def bake(out_dir: Path, **context: str) -> Path:
    """Generate a project with `context` overriding cookiecutter.json; return its directory.

    In a process of its own: cookiecutter changes the working directory while it renders, and the background jobs
    bake in threads of the test process (two bakes at once failed with files not found, 2026-12-04)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.iterdir())
    args = [f"{key}={value}" for key, value in context.items()]
    cmd = [sys.executable, "-m", "cookiecutter", "--no-input", "-o", str(out_dir), str(TEMPLATE), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    (project,) = set(out_dir.iterdir()) - before
    return project


def fresh_env(venv: Path) -> dict[str, str]:
    """A new, empty virtual environment at `venv`, and the environment variables that put it first on PATH.

    Nothing from the environment running the tests leaks in (no PYTHONPATH, no system site packages):
    a baked project's commands run with exactly what its own install steps put there.
    """
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def torch_pin() -> str:
    """The torch a baked project's CI installs (`torch==X.Y.Z`), from the template's constraints.txt."""
    text = (TEMPLATE / "{{cookiecutter.project_slug}}" / "constraints.txt").read_text()
    return re.search(r"^(torch==\S+)$", text, flags=re.MULTILINE).group(1)


def pinned_versions(constraints: Path) -> dict[str, str]:
    """A constraints file's pins, as {name: version}."""
    lines = (line.split("#")[0].strip() for line in constraints.read_text().splitlines())
    return dict(line.split("==") for line in lines if "==" in line)


def run(
    cmd: list[str], cwd: Path | None, timeout: float, env: dict | None = None, grace: float = 0
) -> subprocess.CompletedProcess:
    """Run a command in its own process group; on timeout kill the whole group and fail with its output. With a
    `grace`, SIGTERM first and that many seconds to end: a command that starts processes in sessions of their own
    (a benchmark's runs) stops them on SIGTERM, where SIGKILL to its group would leave them running."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = stop(proc, grace)
        raise AssertionError(f"{cmd} timed out after {timeout}s:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def stop(proc: subprocess.Popen, grace: float) -> str:
    """Stop `proc`'s process group (SIGTERM and `grace` seconds first, if any; then SIGKILL); its output."""
    if grace:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            return proc.communicate(timeout=grace)[0]
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group has already exited
    return proc.communicate()[0]


def workflow_steps(project: Path) -> list[str]:
    """The `run:` commands of the baked GitHub Actions workflow, in order."""
    steps = yaml.safe_load((project / WORKFLOW).read_text())["jobs"]["cpu"]["steps"]
    return [step["run"] for step in steps if "run" in step]
