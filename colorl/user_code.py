"""User code named in a config as `module:name` (a reward, a row map, an environment)."""
from __future__ import annotations

import importlib


class UserCodeError(ValueError):
    """`module:name` could not be imported; one line, without the config key (callers add it)."""


def import_named(spec: str, kind: str = "name"):
    """The attribute `name` of `module` for spec `module:name`, or None if the module has no such attribute.

    kind names what is expected in the error message ("function", "Class").
    """
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise UserCodeError(f"expected 'module:{kind}'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is the user's to fix, in one line
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise UserCodeError(f"cannot import {module_name!r} ({reason})") from None
    return getattr(module, name, None)
