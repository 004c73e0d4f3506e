"""Kernel modules' tuning values set from the command line (`NAME=VALUE`), for the A/B and SASS scripts."""

import importlib


def set_module_value(module: str, item: str) -> None:
    """NAME=VALUE into `module`'s existing bool or int value; SystemExit naming what is wrong otherwise."""
    name, sep, value = item.partition("=")
    m = importlib.import_module(module)
    if not sep or not hasattr(m, name) or type(getattr(m, name)) not in (bool, int):
        raise SystemExit(f"{item!r}: want NAME=VALUE for a bool or int value of {module}")
    if isinstance(getattr(m, name), bool):
        if value not in ("0", "1", "True", "False", "true", "false"):
            raise SystemExit(f"{item!r}: {module}.{name} is a bool (0 / 1)")
        setattr(m, name, value in ("1", "True", "true"))
    else:
        try:
            setattr(m, name, int(value))
        except ValueError:
            raise SystemExit(f"{item!r}: {module}.{name} is an int") from None
