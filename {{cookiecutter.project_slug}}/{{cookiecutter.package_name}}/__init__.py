"""{{ cookiecutter.package_name }}: your models and data (digits/ is the example); the machinery is the ddpkit library
(vendor/ddpkit/)."""
