"""{{ cookiecutter.package_name }}: your models and data (digits/ is the example), and the template's machinery (ddp/)."""
