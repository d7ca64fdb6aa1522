"""Docs as tests: every shell command in the code blocks of the root README and of a baked project's docs (its
README and the library's manual, vendor/ddpkit/docs/) runs and does what the page says (how each is checked:
tests/readme_commands.py); every relative link resolves and every measured figure names its source
(tests/doc_rules.py)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bakes import TEMPLATE, run, torch_pin
from doc_rules import PAGE_MENTION, dead_links, unsourced_figures
from readme_commands import (
    ASIDE_CHAINS,
    CHAINS,
    FRESH,
    GENERATED,
    ROOT,
    Elsewhere,
    NeedsGPU,
    Run,
    doc_files,
    documented_commands,
    forked_args,
    shell_commands,
)

from ddpkit.run.cli import newest_last_checkpoint
from ddpkit.scaling.sweeper import SWEEP_MARKER


@pytest.fixture(scope="module")
def project(readme_project) -> Path:
    return readme_project


def test_pin_in_readme_install_is_the_projects():
    """The README's `pip install torch==...` is the version pyproject.toml pins."""
    assert f"pip install {torch_pin()}" in GENERATED and f"pip install {torch_pin()}" in next(iter(ROOT))


@pytest.mark.parametrize("readme", ["generated", "root"])
def test_every_readme_command_is_listed(project, readme):
    """The tables list exactly the commands of the code blocks of the docs (a baked project's README and manual
    pages; the root README): a new command needs a check."""
    if readme == "generated":
        documented, table = [command for command, _ in documented_commands(project)], GENERATED
    else:
        documented, table = [command for command, _ in shell_commands((TEMPLATE / "README.md").read_text())], ROOT
    assert sorted(set(documented) - set(table)) == [], "add these to the table in tests/readme_commands.py"
    assert sorted(set(table) - set(documented)) == [], "these are no longer in the docs"


def test_the_manual_index_links_every_page_once(project):
    """vendor/ddpkit/docs/index.md links each page of the manual exactly once (the docs' reading order, so every
    page's commands are run), and no page that is not there."""
    manual = project / "vendor" / "ddpkit" / "docs"
    pages = {p.name for p in manual.glob("*.md")} - {"index.md"}
    linked = re.findall(r"\]\(([\w-]+\.md)\)", (manual / "index.md").read_text())
    assert sorted(linked) == sorted(pages) and len(linked) == len(set(linked)), (linked, pages)
    assert [p.name for p in doc_files(project)[1:-1]] == linked


def test_each_command_runs_in_one_chain_and_chains_3_and_4_train_outside_the_project():
    """The chains of run_readme share no command, and every command of chains 3 and 4 that trains (a fit, a torchrun
    job) has its run folder outside the project, where the first chain's `--ckpt_path last`, `best` and `auto` do
    not look."""
    listed = [command for commands in CHAINS.values() for command in commands]
    assert len(listed) == len(set(listed)) and set(listed) <= set(GENERATED)
    for command in (c for number in ASIDE_CHAINS for c in CHAINS[number]):
        check = GENERATED[command]
        if isinstance(check, Run) and ("main.py fit" in command or "torchrun.sh" in command):
            assert re.search(r" --trainer\.default_root_dir ASIDE/[\w-]+$", check.command), command  # last: it wins


def test_plain_main_py_commands_fork_and_the_readmes_fit_and_shell_syntax_start_anew():
    """A documented `python main.py ARGS`, variable assignments before it included, runs forked from the server that
    imported main.py (readme_commands.forked_args); the README's `python main.py fit`, a chain of commands, quoting,
    `$` and every other program start under bash as written."""
    assert forked_args("python main.py fit --trainer.devices 2") == ({}, ["fit", "--trainer.devices", "2"])
    assert forked_args("python main.py test     --ckpt_path best") == ({}, ["test", "--ckpt_path", "best"])
    wandb = "WANDB_MODE=offline python main.py fit --config configs/wandb.yaml"
    assert forked_args(wandb) == ({"WANDB_MODE": "offline"}, ["fit", "--config", "configs/wandb.yaml"])
    for command in [
        *FRESH,
        "python main.py fit --trainer.max_steps 20 && python main.py test --ckpt_path best",
        'pip install -e ".[dev]" -c constraints.txt',
        "python -m ddpkit.parity runs/one runs/eight",
        "NNODES=1 GPUS_PER_NODE=2 bash cluster/torchrun.sh",
        "python main.py fit --config $CONFIG",
        "python main.py fit > out.txt",
    ]:
        assert forked_args(command) is None, command


@pytest.fixture(scope="module")
def outcomes(readme_runs) -> dict:
    """Every command of the generated README: {command: (what ran, exit status, output)} (readme_commands.py;
    started in the background by tests/conftest.py)."""
    return readme_runs.result(timeout=3600)


def test_commands_leave_the_projects_config_alone(project, outcomes):
    """No documented command rewrites the project's config.yaml (the debug preset runs without a logger, and
    Lightning would otherwise save the run's config over it)."""
    assert (project / "config.yaml").read_text() == outcomes["config.yaml before"]


@pytest.mark.parametrize("command", list(GENERATED))
def test_generated_readme_command_works(project, outcomes, command):
    """Each command of the generated README does what its check says (see the module docstring)."""
    check = GENERATED[command]
    if isinstance(check, Elsewhere):
        where = check.test.split("::")
        if where[0].startswith("tests/"):  # a test of this suite: it must exist
            assert f"def {where[1]}(" in (TEMPLATE / where[0]).read_text()
        return
    ran, code, out = outcomes[command]
    if isinstance(check, NeedsGPU):
        if torch.cuda.is_available():
            pytest.skip("a GPU is visible: the command is not refused here")
        errors = [line for line in out.splitlines() if "error:" in line]
        assert code == 2 and errors == [f"error: {check.error}"], out[-3000:]
        assert outcomes[command + " --print_config"][1] == 0, outcomes[command + " --print_config"][2][-3000:]
        return
    assert code == 0, f"$ {ran}\n{out[-5000:]}"
    for text in check.expect:
        assert text in out, f"{text!r} not in the output of $ {ran}:\n{out[-5000:]}"
    for text in getattr(check, "absent", []):
        assert text not in out, f"{text!r} in the output of $ {ran}:\n{out[-5000:]}"


def test_shown_output_matches_what_runs(project):
    """Where a page shows a command's output, the lines the tests check are in what it shows."""
    shown = {command: output for command, output in documented_commands(project) if output}
    assert len(shown) == 2
    for command, output in shown.items():
        for text in GENERATED[command].expect:
            assert text in output, (command, text)


def test_default_fit_reaches_the_documented_accuracy(project, outcomes):
    """`python main.py fit` reaches "about 97% validation accuracy" (the README's claim), in its first run."""
    last = torch.load(project / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    (state,) = [s for s in last["callbacks"].values() if "best_model_score" in s]
    assert float(state["best_model_score"]) >= 0.96


def test_cpu_sweep_compares_like_with_like(project, outcomes):
    """`python -m ddpkit.scaling --devices 1 2 -- --trainer.accelerator cpu` as written gives each process 1 thread on
    this 2-core machine, the 1-process run too, as the doctor measured in every rank (when the 1-process run got
    2 threads that fought each other, 2 processes came out 4.2x as efficient). Only the threads are asserted: the
    README's commands run beside other jobs, so their timings are not comparable here (test_doctor.py's sweep,
    run alone, is)."""
    record = json.loads((project / "scaling/scaling.json").read_text())
    assert record["threads_per_process"] == 1 and sorted(row["devices"] for row in record["rows"]) == [1, 2]
    for n in (1, 2):
        summary = json.loads(next((project / f"scaling/devices_{n}").rglob("doctor.json")).read_text())
        assert summary["cpu_threads_per_rank"] == 1 and len(summary["ranks"]) == n


def test_ckpt_path_last_skips_the_sweeps_runs(project, outcomes):
    """The sweeps (chain 2) write last.ckpt files under scaling/ while the first chain evaluates: its
    `--ckpt_path last` and `best` load the first chain's training, and so does `last` from the root afterwards."""
    assert (project / "scaling" / SWEEP_MARKER).is_file() and list((project / "scaling").rglob("last.ckpt"))
    for command in [
        "python main.py validate --ckpt_path last",
        "python main.py test     --ckpt_path best",
        "python main.py predict  --ckpt_path last",
    ]:
        (loaded,) = re.findall(r"--ckpt_path (?:last|best) is (\S+)", outcomes[command][2])
        assert "scaling" not in (project / loaded).relative_to(project).parts, loaded  # best: as its fit recorded it
    assert "scaling" not in newest_last_checkpoint(project).relative_to(project).parts


def test_root_readme_main_job_works(tmp_path):
    """The root README's first command bakes the default project and trains it, in this environment (built by
    .ci/run with the README's install commands)."""
    (command,) = [c for c, check in ROOT.items() if isinstance(check, Run)]
    assert command.startswith("pip install torch==2.13.0 && pip install -r requirements.txt && ")
    check = ROOT[command]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = run(["bash", "-c", check.command], tmp_path, 300, env)
    assert result.returncode == 0, result.stdout[-5000:]
    assert all(text in result.stdout for text in check.expect), result.stdout[-5000:]


def test_root_readme_gpu_check_refuses_without_a_gpu():
    """`python .ci/gpu_check.py` on this GPU-less machine: one `error:` line and status 2, nothing baked or run."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the check would run (for an hour), not refuse")
    (command,) = [c for c, check in ROOT.items() if isinstance(check, NeedsGPU)]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = run(["bash", "-c", command], TEMPLATE, 120, env)
    assert result.returncode == 2 and result.stdout.strip() == f"error: {ROOT[command].error}", result.stdout


def test_root_readme_test_command_is_what_ci_runs():
    (command,) = [c for c, check in ROOT.items() if isinstance(check, Elsewhere)]
    assert command in (TEMPLATE / ".ci" / "run").read_text()


def layout_names(block: str) -> set[str]:
    """The first word of each line of a layout block, without a trailing slash."""
    return {line.split()[0].rstrip("/") for line in block.splitlines() if line.strip()}


def test_generated_readme_layout_lists_every_top_level_entry(lm_project):
    """Every file and directory at the top of a baked project appears in the README's Layout section."""
    project = lm_project  # untouched: no runs, caches or installs beside the baked files
    text = (project / "README.md").read_text()
    layout = text[text.index("## Layout") :]
    layout = layout[: layout.index("\n## ", 1)]
    named = set()
    for block in re.findall(r"^```\n(.*?)^```", layout, flags=re.DOTALL | re.MULTILINE):
        named |= layout_names(block)
    top = {p.name for p in project.iterdir()} - {"README.md", ".gitignore"}
    assert sorted(name for name in top if not any(n == name or n.startswith(name + "/") for n in named)) == []


def test_root_readme_tree_lists_every_top_level_entry():
    """Every tracked file and directory at the top of this repository appears in the README's tree."""
    text = (TEMPLATE / "README.md").read_text()
    tree = text[text.index("## This repository") :]
    named = layout_names(re.search(r"^```\n(.*?)^```", tree, flags=re.DOTALL | re.MULTILINE).group(1))
    tracked = subprocess.run(["git", "ls-files"], cwd=TEMPLATE, capture_output=True, text=True, check=True).stdout
    top = {line.split("/")[0] for line in tracked.splitlines()} - {"README.md", ".gitignore"}
    assert sorted(top - {n.split("/")[0] for n in named}) == []


def markdown_files(project: Path) -> list[Path]:
    """The project's README, the library's README and the manual's pages."""
    return [*doc_files(project), project / "vendor" / "ddpkit" / "README.md"]


@pytest.fixture(params=["default", "examples"])
def baked(request) -> Path:
    """A default bake, and the one with the language-model and streaming examples (the README differs)."""
    return request.getfixturevalue("default_project" if request.param == "default" else "readme_project")


def test_every_relative_link_resolves(baked):
    """Every relative markdown link of the project's README, the library's README and the manual's pages points to a
    file of the bake, and its #anchor to a heading there; every page named as vendor/ddpkit/docs/NAME.md in the
    bake's text files (presets, the library's messages, comments) exists (tests/doc_rules.py)."""
    dead = [line for path in markdown_files(baked) for line in dead_links(path, baked)]
    assert dead == []
    manual = baked / "vendor" / "ddpkit" / "docs"
    named = set()
    for path in (p for p in baked.rglob("*") if p.suffix in (".md", ".py", ".yaml", ".toml", ".sbatch")):
        try:
            text = path.read_text()
        except (FileNotFoundError, IsADirectoryError):  # a run's file, gone since (the docs' commands run beside)
            continue
        named |= {(path.relative_to(baked), page) for page in PAGE_MENTION.findall(text)}
    assert named and [(str(p), page) for p, page in sorted(named) if not (manual / page).is_file()] == []


def test_every_measured_figure_names_its_source(baked):
    """Every paragraph, list item and table row of the project's README, the library's README and the manual that
    states a measured figure (a time, a size, a percentage, an `Nx` ratio) carries a date, names a test or
    measurements.md (tests/doc_rules.py says exactly what counts)."""
    assert [line for path in markdown_files(baked) for line in unsourced_figures(path)] == []


def test_the_manual_is_the_librarys_and_has_no_template_syntax(default_project):
    """The manual is copied unrendered with the library: no `{{`, `{%` or cookiecutter variable in it."""
    for path in (default_project / "vendor" / "ddpkit" / "docs").glob("*.md"):
        text = path.read_text()
        assert "{{" not in text and "{%" not in text and "cookiecutter" not in text, path.name
