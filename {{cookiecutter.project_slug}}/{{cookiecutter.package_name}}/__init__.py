"""{{ cookiecutter.package_name }}: model, data and samplers for multi-device training with Lightning."""
