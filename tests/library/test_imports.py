"""`import ddpkit` loads a public name's module on first use: `python -m ddpkit.scaling` (the sweep's driver,
`--explain`) then starts without torch or Lightning, ~3 s less per command; every public name still comes from
`ddpkit`."""

import subprocess
import sys

import pytest

import ddpkit

UNNEEDED = ("torch", "lightning")


def test_the_sweeps_driver_imports_neither_torch_nor_lightning():
    code = f"import sys, ddpkit.scaling.sweeper; print([m for m in {UNNEEDED!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_tuning_worker_imports_neither_torch_nor_lightning():
    """`python -m ddpkit.tune` runs trials as processes of their own: its start and its --help pay no torch."""
    code = f"import sys, ddpkit.tune.search; print([m for m in {UNNEEDED!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_presets_command_imports_neither_torch_nor_lightning():
    """`python -m ddpkit.presets` lists and copies files: it pays no torch start-up."""
    code = f"import sys, ddpkit.presets; print([m for m in {UNNEEDED!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_dir_lists_the_public_names_before_they_load():
    """In a fresh interpreter, before any name is used (after a lookup, the name is a plain attribute anyway)."""
    code = "import ddpkit; print(sorted(set(ddpkit.__all__) - set(dir(ddpkit))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_public_name_comes_from_the_package():
    assert sorted(ddpkit.__all__) == sorted(set(ddpkit.__all__))
    for name in ddpkit.__all__:
        assert getattr(ddpkit, name) is not None, name
    assert ddpkit.GlobalBatchDataModule.__module__ == "ddpkit.data.global_batch"
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        ddpkit.no_such_name  # noqa: B018
