"""The library's layout: one subpackage per concern (data, model, run, scaling, tune, testing), no import cycle
between them, no module past MAX_LINES, and every path of the flat layout (0.4.0) and of the manual still works:
`ddpkit.<old module>` imports as the very module of its new path (ddpkit.MOVED), every dotted path the manual, the
READMEs and the configs name resolves, and every documented `python -m ddpkit.X` runs, in its old and new spelling."""

import ast
import fnmatch
import importlib
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ddpkit
import ddpkit.testing.plugin  # noqa: F401  first: it has pytest rewrite the asserts of the checks a path names

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parents[1] / "{{cookiecutter.project_slug}}"
LIBRARY = PROJECT / "vendor" / "ddpkit"
PACKAGE = Path(ddpkit.__file__).parent
# Where users read paths: the manual, the READMEs, design.md, and the configs a project copies or selects.
DOCUMENTS = [
    *sorted((LIBRARY / "docs").glob("*.md")),
    LIBRARY / "README.md",
    PROJECT / "README.md",
    HERE.parents[1] / "README.md",
    HERE.parents[1] / "docs" / "design.md",
    PROJECT / "config.yaml",
    *sorted((PROJECT / "configs").glob("*.yaml")),
    *sorted((PACKAGE / "presets").glob("*.yaml")),
    PACKAGE / "testing" / "toy.yaml",
]
DOTTED = re.compile(r"(?<![\w./-])ddpkit(?:\.[A-Za-z_]\w*)+")
COMMAND = re.compile(r"python -m (ddpkit(?:\.[A-Za-z_]\w*)+)")
# The flat layout's modules (0.4.0 and what was added before the regrouping): users' code and configs name them.
FLAT = """batchnorm checkpoints checks ckpt_paths cli compiling data diagnosis doctor faults gap hang logdirs lr_finder
lr_sweep matmul measure predictions processes record requeue sampling scaling schedules sharding sources stop
strategy streaming study throughput toy trackers trial tune tune_checks tune_devices tune_report tune_run tune_space
tune_worker""".split()
MAX_LINES = 360  # "small enough to read in one sitting"
# The compare command (361 lines) reads runs and judges them; split it when it next grows.
LONGER = {"parity.py"}
# Concerns with a package of their own; the rest of the top level is ddpkit/__init__.py and its three modules.
SUBPACKAGES = ("data", "model", "run", "scaling", "tune", "testing", "presets")


def documented(pattern: re.Pattern) -> set[str]:
    return {m.group(m.lastindex or 0) for path in DOCUMENTS for m in pattern.finditer(path.read_text())}


def resolve(path: str):
    """The object a dotted path names: its longest importable prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


@pytest.mark.parametrize("old", [f"ddpkit.{name}" for name in FLAT])
def test_an_old_module_path_imports_as_the_new_module(old):
    """`import ddpkit.<old>` gives the new module itself (one object: classes stay identical), or, for the three
    modules that became their concern's package, the package hands out each of the old module's names."""
    assert old in ddpkit.MOVED
    new = importlib.import_module(ddpkit.MOVED[old])
    assert new.__spec__.name == new.__name__ == ddpkit.MOVED[old]
    module = importlib.import_module(old)
    if ddpkit.MOVED[old].startswith(old + "."):
        names = module._OLD_NAMES
        defined = {n for n, v in vars(new).items() if getattr(v, "__module__", None) == new.__name__}
        assert {n for n in defined if not n.startswith("_")} <= set(names), f"{old} lacks names of {new.__name__}"
        for name, home in names.items():
            assert getattr(module, name) is getattr(importlib.import_module(f"{old}.{home}"), name), name
    else:
        assert module is new and sys.modules[old] is new
        assert getattr(sys.modules["ddpkit"], old.rpartition(".")[2]) is new  # `from ddpkit import <old>` too


# Classes that users' config.yaml files and 0.4.0 checkpoints name by their old path.
OLD_CLASSES = {
    "ddpkit.checkpoints.CurrentModelCheckpoint": "ddpkit.run.checkpoints.CurrentModelCheckpoint",
    "ddpkit.strategy.TimedDDPStrategy": "ddpkit.run.strategy.TimedDDPStrategy",
    "ddpkit.schedules.WarmupCosine": "ddpkit.model.schedules.WarmupCosine",
    "ddpkit.batchnorm.SyncBatchNormAnyDevice": "ddpkit.model.batchnorm.SyncBatchNormAnyDevice",
    "ddpkit.streaming.StreamingDataModule": "ddpkit.data.streaming.StreamingDataModule",
    "ddpkit.throughput.MFUThroughputMonitor": "ddpkit.scaling.throughput.MFUThroughputMonitor",
    "ddpkit.sharding.LayerFSDPStrategy": "ddpkit.model.sharding.LayerFSDPStrategy",
    "ddpkit.data.GlobalBatchDataModule": "ddpkit.data.global_batch.GlobalBatchDataModule",
    "ddpkit.trackers.MLFlowLogger": "ddpkit.run.trackers.MLFlowLogger",
}


def test_a_pickle_or_config_naming_an_old_class_path_gets_the_class():
    """A 0.4.0 pickle (a GLOBAL opcode: module, then name) and a config's class_path load the same class object."""
    for old, new in OLD_CLASSES.items():
        module, _, name = old.rpartition(".")
        assert pickle.loads(f"c{module}\n{name}\n.".encode()) is resolve(new), old
        assert resolve(old) is resolve(new) and resolve(new).__module__ == new.rpartition(".")[0], old


def test_every_documented_dotted_path_resolves():
    """Each `ddpkit.x.y` the manual, the READMEs, design.md and the configs name is a module or an attribute."""
    paths = documented(DOTTED)
    assert len(paths) > 30 and "ddpkit.testing.plugin" in paths
    unresolved = []
    for path in sorted(paths):
        try:
            resolve(path)
        except (ImportError, AttributeError) as error:
            unresolved.append(f"{path}: {error}")
    assert not unresolved, "\n".join(unresolved)


RUN_AS_MAIN = """
import contextlib, io, json, runpy, sys, warnings
warnings.simplefilter("ignore")  # runpy warns when a module it runs was imported by an earlier one
results = {}
for name in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [name, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
            code = "no exit"
        except SystemExit as exit:
            code = exit.code or 0
        except BaseException as error:
            code = repr(error)
    usage = [line for line in out.getvalue().splitlines() if line.startswith("usage:")]
    results[name] = [code, usage[0] if usage else out.getvalue()[-2000:]]
print(json.dumps(results))
"""


def test_every_documented_command_runs_in_its_old_and_new_spelling():
    """`python -m X --help` exits 0 with its usage line for every documented X and its new path; runpy runs each
    (as `python -m` does) in one interpreter, and one old spelling runs through a real `python -m`."""
    commands = documented(COMMAND)
    assert {"ddpkit.tune", "ddpkit.scaling", "ddpkit.faults", "ddpkit.lr_finder", "ddpkit.toy"} <= commands
    news = {ddpkit.MOVED[c] for c in commands if c in ddpkit.MOVED and not ddpkit.MOVED[c].startswith(c + ".")}
    names = sorted(commands) + sorted(news - commands)  # the old spellings first: none was imported before
    out = subprocess.run(
        [sys.executable, "-c", RUN_AS_MAIN, *names], capture_output=True, text=True, timeout=300, check=True
    )
    results = json.loads(out.stdout.splitlines()[-1])
    failed = {name: r for name, r in results.items() if r[0] != 0 or not r[1].startswith("usage:")}
    assert not failed, failed
    real = subprocess.run(
        [sys.executable, "-m", "ddpkit.lr_finder", "--help"], capture_output=True, text=True, timeout=120
    )
    assert real.returncode == 0 and real.stdout.startswith("usage: python -m ddpkit.lr_finder"), real.stderr


def library_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_longer_than_max_lines():
    """Every module but those in LONGER fits MAX_LINES (testing/'s runs and checks too, since runs.py gave its waves'
    command lines to waves.py and check_parity.py its bounds to bounds.py)."""
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in library_files()
        if str(p.relative_to(PACKAGE)) not in LONGER
        and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def concern(module: str) -> str:
    """The subpackage (or top-level module) a dotted module name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ddpkit"


def imported(path: Path) -> set[str]:
    """The ddpkit modules a file imports, anywhere in it (a lazy import inside a function counts too)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ddpkit")}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            if target.startswith("ddpkit"):
                # `from ddpkit import presets`: a module; `from ddpkit import GlobalBatchDataModule`: the top
                found |= {
                    f"{target}.{a.name}" if target == "ddpkit" and a.name in SUBPACKAGES else target for a in node.names
                }
    return found


def concern_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in library_files():
        source = concern(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"))
        graph.setdefault(source, set()).update(c for c in map(concern, imported(path)) if c != source)
    return graph


def test_no_import_cycle_between_subpackages():
    """What imports what between the concerns (ast, lazy imports included) is a graph without a cycle."""
    graph = concern_graph()
    assert {"run", "data", "model"} <= graph.keys() and "data" in graph["run"]
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(node) :], node]))
        if node not in done:
            for child in sorted(graph.get(node, ())):
                visit(child, [*path, node])
            done.add(node)

    for node in sorted(graph):
        visit(node, [])


def test_the_projects_gitignore_hides_no_part_of_the_library():
    """A baked project's .gitignore names output folders (scaling/, tune/): anchored at the project's root, none of
    them matches a folder or file of vendor/ddpkit, which the project's git must keep."""
    patterns = [
        line.strip()
        for line in (PROJECT / ".gitignore").read_text().splitlines()
        if line.strip() and not line.startswith("#") and "{%" not in line
    ]
    unanchored = [p for p in patterns if "/" not in p.rstrip("/")]  # git matches these at any depth
    assert "/scaling/" in patterns and "runs/" in unanchored
    hidden = sorted(
        f"{path.relative_to(PROJECT)} ({pattern})"
        for path in LIBRARY.rglob("*")
        if not any(part.startswith((".", "__pycache__")) for part in path.relative_to(LIBRARY).parts)  # caches
        for pattern in unanchored
        if (path.is_dir() or not pattern.endswith("/")) and fnmatch.fnmatch(path.name, pattern.rstrip("/"))
    )
    assert not hidden, hidden
