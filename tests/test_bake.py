"""Baking the template: the files it writes, the names it refuses, and the project's own tests."""

import py_compile
import re
import sys
import tomllib
from pathlib import Path

import pytest
from bakes import TEMPLATE, WORKFLOW, bake, pinned_versions, run, torch_pin, workflow_steps
from cookiecutter.exceptions import FailedHookException
from cookiecutter.main import cookiecutter
from packaging.requirements import Requirement

# The user's project: what a default bake writes besides the library (vendor/ddpkit, checked as a whole below).
COMMON = {
    ".gitignore",
    "LICENSE",
    "README.md",
    "cluster/slurm.sbatch",
    "cluster/torchrun.sh",
    "cluster/trainjob.yaml",
    "cluster/tune.sbatch",
    "config.yaml",
    "constraints.txt",
    "configs/debug.yaml",
    "configs/model_parallel.yaml",
    "configs/mlflow.yaml",
    "configs/wandb.yaml",
    "configs/tune.yaml",
    "main.py",
    "pyproject.toml",
    "ddp_digits/__init__.py",
    "ddp_digits/digits/__init__.py",
    "ddp_digits/digits/data.py",
    "ddp_digits/digits/digits.csv.gz",
    "ddp_digits/digits/model.py",
    "ddp_digits/digits/module.py",
    "tests/conftest.py",
    "tests/test_guarantees.py",
    "tests/examples/digits.yaml",
    "tests/examples/test_digits_cli.py",
    "tests/examples/test_digits_data.py",
    "tests/examples/test_digits_module.py",
}
LM_EXAMPLE = {
    "configs/lm.yaml",
    "configs/fsdp.yaml",
    "ddp_digits/lm/__init__.py",
    "ddp_digits/lm/data.py",
    "ddp_digits/lm/ecclesiastes.txt",
    "ddp_digits/lm/gpt.py",
    "ddp_digits/lm/module.py",
    "tests/examples/test_lm.py",
    "tests/examples/test_lm_sharded.py",
}
STREAM_EXAMPLE = {
    "configs/stream.yaml",
    "ddp_digits/stream/__init__.py",
    "ddp_digits/stream/data.py",
    "tests/examples/test_stream.py",
}
LIBRARY = TEMPLATE / "{{cookiecutter.project_slug}}" / "vendor" / "ddpkit"


def files(project: Path) -> set[str]:
    """The project's files outside vendor/ (the library, compared whole with the template's)."""
    return {
        str(p.relative_to(project))
        for p in project.rglob("*")
        if p.is_file() and p.parts[len(project.parts)] != "vendor"
    }


def library_files(root: Path) -> dict[str, bytes]:
    """The library's source files under `root` (a bake's vendor/ddpkit or the template's), without caches that
    running it leaves in the template's working tree."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p)
    }


def test_default_bake_writes_exactly_the_expected_files(default_project):
    """Defaults give the slug directory with the package, tests, data and CI workflow, and no LM example."""
    assert default_project.name == "ddp-digits"
    assert files(default_project) == COMMON | {WORKFLOW}


def test_the_library_is_carried_unrendered_and_whole(default_project):
    """vendor/ddpkit is the template's library byte for byte (copied without rendering: no template syntax reaches
    it, none is needed), with its pyproject.toml and version, and nothing else (no caches)."""
    baked = {str(p.relative_to(default_project / "vendor" / "ddpkit")) for p in (default_project / "vendor").rglob("*")}
    assert not any("__pycache__" in name for name in baked)
    assert library_files(default_project / "vendor" / "ddpkit") == library_files(LIBRARY)
    meta = tomllib.loads((LIBRARY / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "ddpkit" and meta["tool"]["hatch"]["version"]["path"] == "src/ddpkit/__init__.py"
    assert re.search(r'^__version__ = "\d+\.\d+\.\d+"$', (LIBRARY / "src/ddpkit/__init__.py").read_text(), re.M)


def test_the_users_rooms_stay_small(default_project):
    """The user's package holds only the example (at most 500 Python lines) and the tests outside
    tests/examples are the few lines that select the library's suite."""

    def lines(paths):
        return sum(len(p.read_text().splitlines()) for p in paths)

    package = default_project / "ddp_digits"
    assert {p.name for p in package.iterdir()} == {"__init__.py", "digits"}
    assert lines(package.rglob("*.py")) <= 500
    tests = [p for p in (default_project / "tests").glob("*.py")]
    assert lines(tests) <= 100, [str(p) for p in tests]


def test_the_package_docstring_names_folders_that_exist(default_project):
    """Each folder the user's package's docstring names (`digits/`, `vendor/ddpkit/`) is in the bake: 0.5.2's named
    a `ddp/` that was not."""
    package = default_project / "ddp_digits"
    named = re.findall(r"([\w/]+)/\W", (package / "__init__.py").read_text())
    assert named and all((package / n).is_dir() or (default_project / n).is_dir() for n in named), named


def test_the_generic_presets_are_the_librarys(default_project):
    """configs/ starts with a copy of each preset the library ships (ddpkit/presets, their one source), byte for
    byte, which `python -m ddpkit.presets` then reports as in configs/."""
    shipped = sorted((LIBRARY / "src" / "ddpkit" / "presets").glob("*.yaml"))
    assert [p.stem for p in shipped] == ["debug", "mlflow", "model_parallel", "wandb"]
    for preset in shipped:
        assert (default_project / "configs" / preset.name).read_bytes() == preset.read_bytes(), preset.name


def test_default_readme_is_the_projects_and_short(default_project):
    """A default bake's README is the project's own, at most 200 lines: install, train, test, the example, the
    layout, and links to the library's manual (vendor/ddpkit/docs/), which holds the rest."""
    readme = (default_project / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for heading in ("## Install", "## Train", "## Test", "## The example, and your own", "## Layout", "## The manual"):
        assert f"\n{heading}\n" in readme, heading
    assert "(vendor/ddpkit/docs/index.md)" in readme


def test_lm_example_is_baked_only_when_asked(lm_project):
    """lm_example=yes adds the language model, its data, presets and tests, and nothing else."""
    assert files(lm_project) == COMMON | LM_EXAMPLE | {WORKFLOW}
    assert "## A second example: a small language model" in (lm_project / "README.md").read_text()


def test_streaming_example_is_baked_only_when_asked(tmp_path, default_project):
    """streaming_example=yes adds the shard-streaming example, its config and test, and its README commands and
    ignored shard folder; a default bake has none of them but the README's link to the manual's streaming page."""
    project = bake(tmp_path, streaming_example="yes")
    assert files(project) == COMMON | STREAM_EXAMPLE | {WORKFLOW}
    readme, default_readme = ((p / "README.md").read_text() for p in (project, default_project))
    assert "configs/stream.yaml" in readme and "configs/stream.yaml" not in default_readme
    assert "## The streaming example" in readme and "## The streaming example" not in default_readme
    assert "(vendor/ddpkit/docs/streaming.md)" in readme and "(vendor/ddpkit/docs/streaming.md)" in default_readme
    assert "data/digit-shards/" in (project / ".gitignore").read_text().splitlines()
    assert "data/digit-shards/" not in (default_project / ".gitignore").read_text()


def test_without_github_actions_the_workflow_is_removed(tmp_path):
    """github_actions=no leaves no .github directory and nothing else missing."""
    project = bake(tmp_path, github_actions="no")
    assert files(project) == COMMON
    assert not (project / ".github").exists()


@pytest.mark.parametrize(
    ("license", "first_line"),
    [
        ("MIT", "MIT License"),
        ("Apache-2.0", "Apache License"),
        ("BSD-3-Clause", "BSD 3-Clause License"),
        ("none", None),
    ],
)
def test_license_prompt_writes_the_license_and_declares_it(tmp_path, license, first_line):
    """The chosen license is the LICENSE file (with the author and year in its copyright line) and the SPDX
    `license` of pyproject.toml; `none` leaves neither."""
    project = bake(tmp_path, license=license, author_name="Ada Lovelace")
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    if first_line is None:
        assert not (project / "LICENSE").exists() and "license" not in meta
        return
    text = (project / "LICENSE").read_text()
    assert text.strip().splitlines()[0].strip() == first_line and meta["license"] == license
    assert re.search(r"Copyright (\(c\) )?20\d\d,? Ada Lovelace\n", text), text[-800:]


def test_custom_names_reach_paths_and_imports(tmp_path):
    """A custom slug and package name rename the directory, the package and its imports."""
    project = bake(tmp_path, project_name="Fancy Net", package_name="fancy")
    assert project.name == "fancy-net"
    assert (project / "fancy" / "digits" / "module.py").is_file()
    assert "class_path: fancy.digits.module.DigitsClassifier" in (project / "config.yaml").read_text()
    assert "from fancy.digits.data import" in (project / "tests/examples/test_digits_data.py").read_text()


def test_no_template_syntax_left(default_project):
    """No `{{`, `{%` or `cookiecutter` remains in any generated text file outside the (unrendered) library."""
    for name in files(default_project):
        path = default_project / name
        if path.suffix not in (".gz", ".png"):
            text = path.read_text()
            assert "{{" not in text and "{%" not in text and "cookiecutter" not in text, path


def test_every_python_file_compiles(default_project, tmp_path):
    """Each generated .py file is valid Python."""
    for path in default_project.rglob("*.py"):
        py_compile.compile(str(path), cfile=str(tmp_path / "x.pyc"), doraise=True)


@pytest.mark.parametrize("name", ["Ddp Digits", "Zz Top"])
def test_generated_project_passes_ruff(tmp_path, name):
    """ruff check and ruff format --check find nothing, with the project's own config, also when the package's
    name sorts after the scripts beside it (import order must not depend on the name)."""
    project = bake(tmp_path, project_name=name, lm_example="yes", streaming_example="yes")
    for cmd in (["ruff", "check", "."], ["ruff", "format", "--check", "."]):
        result = run([sys.executable, "-m", *cmd], project, timeout=60)
        assert result.returncode == 0, result.stdout


def test_pyproject_declares_ranges_and_constraints_pin_the_tested_set(default_project):
    """The project asks for the torch range the library supports and takes the library from vendor/ddpkit, which
    declares ranges; constraints.txt pins every one of those packages, and the dev tools, to one version inside its
    range: the set the template's own CI installs (requirements.txt reads the same file)."""
    meta = tomllib.loads((default_project / "pyproject.toml").read_text())["project"]
    library = tomllib.loads((LIBRARY / "pyproject.toml").read_text())["project"]
    torch_range = [d for d in library["dependencies"] if Requirement(d).name == "torch"]
    assert meta["dependencies"] == [*torch_range, "ddpkit @ {root:uri}/vendor/ddpkit"]
    ranges = {Requirement(d).name: Requirement(d).specifier for d in library["dependencies"]}
    for extra in ("testing", "scaling", "trackers", "tune"):
        ranges |= {Requirement(d).name: Requirement(d).specifier for d in library["optional-dependencies"][extra]}
    ranges |= {Requirement(d).name: Requirement(d).specifier for d in meta["optional-dependencies"]["dev"][1:]}
    pins = pinned_versions(default_project / "constraints.txt")
    assert {name.lower() for name in ranges} <= {name.lower() for name in pins}, (ranges, pins)
    assert all(ranges[name].contains(pins[name]) for name in ranges), (ranges, pins)
    assert "-c {{cookiecutter.project_slug}}/constraints.txt" in (TEMPLATE / "requirements.txt").read_text()
    # The project's extras are the library's, from vendor/ddpkit.
    for extra in ("scaling", "trackers", "tune"):
        assert meta["optional-dependencies"][extra] == [f"ddpkit[{extra}] @ {{root:uri}}/vendor/ddpkit"]


BAD_NAMES = [
    ({"project_slug": "1project"}, "project_slug '1project' is not a valid distribution name"),
    ({"project_slug": "my project"}, "project_slug 'my project' is not a valid distribution name"),
    ({"package_name": "my-pkg"}, "package_name 'my-pkg' is not an importable name"),
    ({"package_name": "9lives"}, "package_name '9lives' is not an importable name"),
    ({"package_name": "class"}, "package_name 'class' is a Python keyword"),
    ({"package_name": "torch"}, "package_name 'torch' would shadow"),
    ({"package_name": "lightning"}, "package_name 'lightning' would shadow"),
    ({"package_name": "json"}, "package_name 'json' would shadow"),
]


@pytest.mark.parametrize(("context", "message"), BAD_NAMES)
def test_bad_names_are_refused_and_nothing_is_written(tmp_path, capfd, context, message):
    """An invalid name stops the bake with a one-line message and leaves no files behind."""
    with pytest.raises(FailedHookException):  # in this process, to see cookiecutter's own exception
        cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(tmp_path), extra_context=context)
    err = capfd.readouterr().err
    assert f"ERROR: {message}" in err and err.strip().count("\n") == 0
    assert list(tmp_path.iterdir()) == []


HOSTILE = 'Evil "quotes" \'\'\' """ \\ {% raw %}{{ 7*7 }} {% endraw %}\nsecond line'


def test_hostile_answers_stay_data(tmp_path):
    """Quotes, backslashes, triple quotes, braces and newlines reach the files verbatim, never as code."""
    literal = HOSTILE.replace("{% raw %}", "").replace("{% endraw %}", "")
    project = bake(
        tmp_path,
        project_name=HOSTILE,
        project_slug="evil",
        package_name="evil",
        description=HOSTILE,
        author_name=HOSTILE,
    )
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["description"] == literal and meta["authors"] == [{"name": literal}]
    assert (project / "README.md").read_text().startswith(f"# {literal}\n")
    for path in project.rglob("*.py"):
        py_compile.compile(str(path), cfile=str(tmp_path / "x.pyc"), doraise=True)


def test_cookiecutter_command_line_no_input(tmp_path):
    """The real `cookiecutter --no-input` command bakes with key=value overrides."""
    result = run(
        ["cookiecutter", "--no-input", str(TEMPLATE), "-o", str(tmp_path), "project_name=Cli Made"],
        tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout
    assert (tmp_path / "cli-made" / "cli_made" / "digits" / "module.py").is_file()
    # Then the next steps, with the torch and the tested set that the project's constraints.txt pins.
    assert "Baked cli-made/. Next" in result.stdout and "\n  cd cli-made\n" in result.stdout
    assert f"pip install {torch_pin()} " in result.stdout and "python main.py fit" in result.stdout
    assert 'pip install -e ".[dev]" -c constraints.txt' in result.stdout


def test_workflow_installs_the_tested_set(default_project):
    """The workflow's first step is the CPU wheel of exactly the torch constraints.txt pins, its second the project
    with those constraints."""
    torch_pin = f"torch=={pinned_versions(default_project / 'constraints.txt')['torch']}"
    steps = workflow_steps(default_project)
    assert steps[0] == f"pip install {torch_pin} --index-url https://download.pytorch.org/whl/cpu"
    assert steps[1] == 'pip install -e ".[dev]" -c constraints.txt'


def test_ci_runs_the_readme_test_command():
    """.ci/run runs, inside its own new virtual environment, the test command the README gives."""
    readme = (TEMPLATE / "README.md").read_text()
    ci = (TEMPLATE / ".ci" / "run").read_text()
    command = (
        "pip install torch==2.13.0 && pip install -r requirements.txt && pip install --no-deps litdata==0.2.76 "
        "&& python -m pytest tests"
    )
    assert f"\n{command}\n" in readme and f"\n{command}\n" in ci
    assert ci.index("python3 -m venv") < ci.index("source") < ci.index(command)
