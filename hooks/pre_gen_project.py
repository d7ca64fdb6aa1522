"""Refuse names that would bake a broken project, before any file is written.

Cookiecutter renders this file, so the values arrive as JSON string literals
(`| tojson`): whatever the user typed stays data.
"""

import keyword
import re
import sys

SLUG = {{ cookiecutter.project_slug | tojson }}
PACKAGE = {{ cookiecutter.package_name | tojson }}

# PEP 508 distribution name, starting with a letter so it also works as a directory name.
SLUG_RE = re.compile(r"^[A-Za-z][A-Za-z0-9._-]*[A-Za-z0-9]$|^[A-Za-z]$")
PACKAGE_RE = re.compile(r"^[a-z_][a-z0-9_]*$")
# Importing the project would hide these: the project's own code or its dependencies break.
SHADOWED = {
    "lightning", "pytorch_lightning", "torch", "torchmetrics", "tensorboard",
    "jsonargparse", "numpy", "pytest", "main", "tests", "test", "setuptools", "ddpkit", "vendor",
}


def problem(slug: str, package: str) -> str | None:
    """Return a one-line, actionable complaint, or None when both names are fine."""
    if not SLUG_RE.match(slug):
        return (
            f"project_slug {slug!r} is not a valid distribution name: use letters, digits, '-', '_' "
            "or '.', starting with a letter (e.g. project_slug=my-project)."
        )
    if not PACKAGE_RE.match(package):
        return (
            f"package_name {package!r} is not an importable name: use lowercase letters, digits and "
            "'_' only, not starting with a digit (e.g. package_name=my_project)."
        )
    if keyword.iskeyword(package):
        return f"package_name {package!r} is a Python keyword: pick another (e.g. package_name={package}_lib)."
    if package in SHADOWED or package in sys.stdlib_module_names:
        return (
            f"package_name {package!r} would shadow the module of the same name that the project "
            f"imports: pick another (e.g. package_name=my_{package})."
        )
    return None


if __name__ == "__main__":
    message = problem(SLUG, PACKAGE)
    if message:
        print(f"ERROR: {message}", file=sys.stderr)
        sys.exit(1)
