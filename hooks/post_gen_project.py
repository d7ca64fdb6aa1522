"""Drop the files of options the user turned off."""

import shutil
from pathlib import Path

if {{ cookiecutter.github_actions | tojson }} != "yes":
    shutil.rmtree(Path(".github"))
