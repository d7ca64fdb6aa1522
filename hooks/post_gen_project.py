"""Drop the files of options the user turned off."""

import shutil
from pathlib import Path

PACKAGE = Path({{ cookiecutter.package_name | tojson }})

if {{ cookiecutter.github_actions | tojson }} != "yes":
    shutil.rmtree(Path(".github"))

if {{ cookiecutter.lm_example | tojson }} != "yes":
    # The language-model example is a second set of user files: a project carries only what it uses.
    shutil.rmtree(PACKAGE / "lm")
    for path in ("configs/lm.yaml", "configs/fsdp.yaml", "tests/examples/test_lm.py", "tests/examples/test_lm_sharded.py"):
        Path(path).unlink()
