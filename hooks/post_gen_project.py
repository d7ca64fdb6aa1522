"""Drop the files of options the user turned off, then say what to do next."""

import shutil
from pathlib import Path

PACKAGE = Path({{ cookiecutter.package_name | tojson }})
SLUG = {{ cookiecutter.project_slug | tojson }}

# Cookiecutter copies the template's folder as it is on disk: caches that running the library's tests in the
# template repository left there are not the library.
for cache in list(Path("vendor").rglob("__pycache__")):
    shutil.rmtree(cache, ignore_errors=True)

# The generic presets are the library's package data (one source: ddpkit/presets); the project starts with a copy
# of each in configs/, which is the user's from then on. `python -m ddpkit.presets` brings later ones.
for preset in sorted(Path("vendor/ddpkit/src/ddpkit/presets").glob("*.yaml")):
    shutil.copyfile(preset, Path("configs") / preset.name)

if {{ cookiecutter.github_actions | tojson }} != "yes":
    shutil.rmtree(Path(".github"))

if {{ cookiecutter.license | tojson }} == "none":
    Path("LICENSE").unlink()

if {{ cookiecutter.lm_example | tojson }} != "yes":
    # The language-model example is a second set of user files: a project carries only what it uses.
    shutil.rmtree(PACKAGE / "lm")
    for path in ("configs/lm.yaml", "configs/fsdp.yaml", "tests/examples/test_lm.py", "tests/examples/test_lm_sharded.py"):
        Path(path).unlink()

if {{ cookiecutter.streaming_example | tojson }} != "yes":
    shutil.rmtree(PACKAGE / "stream")
    for path in ("configs/stream.yaml", "tests/examples/test_stream.py"):
        Path(path).unlink()

print(
    f"Baked {SLUG}/. Next, in a new virtual environment:\n"
    f"  cd {SLUG}\n"
    "  pip install torch==2.13.0                     # first: the build for your hardware\n"
    '  pip install -e ".[dev]" -c constraints.txt    # the versions the template tests\n'
    "  python main.py fit                            # ~20 s on 2 CPU cores; README.md has the rest"
)
