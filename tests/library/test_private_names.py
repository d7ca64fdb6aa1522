"""Private names of Lightning and torch are used only through `ddpkit.lightning_internals`.

Each private name is a debt a new release may call in; kept in one module, an upgrade has one file to
mend and `test_lightning_internals.py` says which name moved. This test reads every module of the
installed package (`ddpkit.testing` included) and reports any other module that uses one.
"""

import ast
import importlib
import importlib.util
import inspect
import textwrap
from functools import cache
from pathlib import Path

import pytest

import ddpkit

# The one module allowed to use private names (it lists them in PRIVATE_NAMES).
ALLOWED_MODULE = "ddpkit.lightning_internals"
# Packages whose private names count: Lightning, torch and what LightningCLI is built on.
WATCHED = {"torch", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "torchmetrics",
           "jsonargparse"}
# Underscore names that the standard library documents as public API.
PUBLIC_UNDERSCORE = {("os", "_exit")} | {("*", n) for n in ("_replace", "_asdict", "_fields", "_make")}
ATTRIBUTE_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}


def is_private(name: str) -> bool:
    """`_x` and `__x` are private; `__x__` (dunder) is not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def watched(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in WATCHED


@cache
def external_names(cls: type) -> frozenset[str]:
    """Private names a watched base class of `cls` defines: its class attributes and methods, and the
    `self._x` attributes its source sets or reads."""
    names: set[str] = set()
    for base in cls.__mro__:
        if not watched(base.__module__):
            continue
        names.update(n for n in vars(base) if is_private(n))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):  # compiled classes have no source
            continue
        names.update(
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            and is_private(node.attr)
        )
    return frozenset(names)


def resolve(expression: str, namespace: dict) -> object:
    """The class a base-class expression (`L.Callback`) names in the module, or None when it cannot be found."""
    try:
        return eval(expression, namespace)  # noqa: S307 - a dotted name from the library's own source
    except Exception:
        return None


def private_uses(source: str, namespace: dict) -> list[str]:
    """Each private use in `source` as "line N: what", given the module's `namespace` to resolve class bases."""
    found: list[str] = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"line {node.lineno}: {what}")

    def visit(node: ast.AST, inherited: frozenset[str] | None) -> None:
        # `inherited`: inside a class body, the private names its watched bases define; None outside classes.
        if isinstance(node, ast.ClassDef):
            bases = [resolve(ast.unparse(b), namespace) for b in node.bases]
            inherited = frozenset().union(*(external_names(b) for b in bases if isinstance(b, type)))
            for item in node.body:
                names = [item.name] if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
                targets = [item.target] if isinstance(item, ast.AnnAssign) else getattr(item, "targets", [])
                names += [t.id for t in targets if isinstance(t, ast.Name)]
                for name in names:
                    if name in inherited:
                        report(item, f"overrides {name}, defined by a Lightning/torch base class")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if watched(alias.name) and any(is_private(p) for p in alias.name.split(".")):
                    report(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and watched(node.module):
            if any(is_private(p) for p in node.module.split(".")):
                report(node, f"from {node.module} import ...")
            for alias in node.names:
                if is_private(alias.name):
                    report(node, f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if (owner, node.attr) in PUBLIC_UNDERSCORE or ("*", node.attr) in PUBLIC_UNDERSCORE:
                pass
            elif owner not in ("self", "cls") or inherited is None:
                report(node, f"{ast.unparse(node)}")
            elif node.attr in inherited:
                report(node, f"{owner}.{node.attr}, defined by a Lightning/torch base class")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_FUNCTIONS:
            target = node.args[1] if len(node.args) > 1 else None
            if isinstance(target, ast.Constant) and isinstance(target.value, str) and is_private(target.value):
                report(node, f"{node.func.id}(..., {target.value!r})")
        for child in ast.iter_child_nodes(node):
            visit(child, inherited)

    visit(ast.parse(source), None)
    return found


def library_modules() -> list[str]:
    """Every module of the installed ddpkit package, by its files (`ddpkit.testing` has no `__init__`)."""
    root = Path(ddpkit.__file__).parent
    names = {".".join(("ddpkit", *p.relative_to(root).with_suffix("").parts)) for p in root.rglob("*.py")}
    return sorted(n.removesuffix(".__init__") for n in names if n != ALLOWED_MODULE)


def module_uses(name: str) -> list[str]:
    """The private uses of one library module, read from its file."""
    spec = importlib.util.find_spec(name)
    source = Path(spec.origin).read_text()
    try:
        namespace = vars(importlib.import_module(name))
    except ImportError:
        # A module that imports its siblings by plain name (pytest's rootdir-relative imports) loads only
        # under its own test run; its imports of Lightning and torch are enough to resolve watched bases.
        namespace = {}
        for node in ast.parse(source).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                try:
                    exec(compile(ast.Module([node], []), name, "exec"), namespace)  # noqa: S102
                except ImportError:
                    pass
    return private_uses(source, namespace)


@pytest.mark.parametrize("name", library_modules())
def test_module_uses_no_private_name(name):
    """No module but lightning_internals uses a private name of Lightning or torch."""
    uses = module_uses(name)
    assert not uses, f"{name} uses private names (move them to {ALLOWED_MODULE}): " + "; ".join(uses)


def test_every_module_is_checked():
    """The scan sees the library's modules, its testing subpackage included, and leaves out only one."""
    names = library_modules()
    assert {"ddpkit.run.cli", "ddpkit.scaling.doctor", "ddpkit.run.faults", "ddpkit.scaling.sweeper"} <= set(names)
    assert any(n.startswith("ddpkit.testing.") for n in names)
    assert ALLOWED_MODULE not in names and len(names) >= 20


def snippet_uses(source: str) -> list[str]:
    source = textwrap.dedent(source)
    namespace: dict = {}
    exec(compile(source, "<snippet>", "exec"), namespace)  # noqa: S102 - the test's own text
    return private_uses(source, namespace)


def test_clean_snippet_reports_nothing():
    """Public names, a class's own private attributes and os._exit are not reported."""
    assert snippet_uses("""
        import os
        from lightning.pytorch.callbacks import Callback
        from torch.distributed.fsdp import FullyShardedDataParallel

        class Mine(Callback):
            _limit = 3

            def __init__(self):
                self._count = 0

            def _step(self):
                self._count += self._limit
                return FullyShardedDataParallel, os._exit
        """) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import torch\nx = torch.distributed.distributed_c10d._set_pg_timeout",
         "line 2: torch.distributed.distributed_c10d._set_pg_timeout"),
        ("import torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
         "line 1: import torch.distributed.algorithms._checkpoint.checkpoint_wrapper"),
        ("from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper",
         "line 1: from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ..."),
        ("from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop",
         "line 1: from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop"),
        ("def f(strategy):\n    return getattr(strategy, '_ddp_comm_hook', None)",
         "line 2: getattr(..., '_ddp_comm_hook')"),
        ("from lightning.pytorch.cli import LightningCLI\nclass C(LightningCLI):\n"
         "    def _run_subcommand(self, subcommand):\n        pass",
         "line 3: overrides _run_subcommand, defined by a Lightning/torch base class"),
        ("from lightning.pytorch.cli import LightningCLI\nclass C(LightningCLI):\n"
         "    def run(self):\n        return super()._get(self.config, 'x')",
         "line 4: super()._get"),
        ("from lightning.pytorch.callbacks import ModelCheckpoint\nclass K(ModelCheckpoint):\n"
         "    _save_last_checkpoint: object = None",
         "line 3: overrides _save_last_checkpoint, defined by a Lightning/torch base class"),
        ("from lightning.pytorch.callbacks import ThroughputMonitor\nclass M(ThroughputMonitor):\n"
         "    def peak(self):\n        return self._throughputs",
         "line 4: self._throughputs, defined by a Lightning/torch base class"),
    ],
    ids=["attribute", "import", "import-from-module", "import-name", "getattr", "override", "super", "class-attribute",
         "inherited"],
)
def test_private_use_is_reported(source, expected):
    """Each kind of private use is reported with its line."""
    assert snippet_uses(source) == [expected]
