"""Load a user's function from an import path given on the command line ("pkg.mod:fn").

Every error names the flag that carried the path, so a typo in `--custom-generate-function-path`
reads as such instead of as a bare ModuleNotFoundError deep in a rollout.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any


class ImportPathError(ImportError, ValueError):
    """An import path given by a flag does not name a callable that can be imported.

    Also a ValueError: the flag's value is what is wrong, and config validation raises ValueError.
    """


def split_import_path(path: str, flag: str) -> tuple[str, list[str]]:
    """`"pkg.mod:obj.fn"` or `"pkg.mod.fn"` -> `("pkg.mod", ["obj", "fn"])`; checks syntax only."""
    if not isinstance(path, str) or not path.strip():
        raise ImportPathError(
            f"{flag} {path!r} is not an import path; write 'package.module:function'"
        )
    path = path.strip()
    if ":" in path:
        module, _, attrs = path.partition(":")
    else:
        module, _, attrs = path.rpartition(".")
    names = attrs.split(".") if attrs else []
    if not module or not names or not all(name.isidentifier() for name in names):
        raise ImportPathError(
            f"{flag} {path!r} is not an import path; write 'package.module:function' "
            "(or 'package.module.function')"
        )
    return module, names


def load_function(path: str, flag: str) -> Callable[..., Any]:
    """Import and return the callable that `path` names; `flag` is quoted in every error."""
    target = load_object(path, flag)
    if not callable(target):
        raise ImportPathError(
            f"{flag} {path!r} names a {type(target).__name__}, not a function; point it at a "
            "callable"
        )
    return target


def load_object(path: str, flag: str) -> Any:
    """Import and return whatever `path` names (a function, a class, a spec object)."""
    module_name, names = split_import_path(path, flag)
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # Only a missing module *named by the path* is the user's typo; a missing dependency of
        # that module is a different problem, so say which module was not found.
        missing = err.name or module_name
        where = "" if missing == module_name else f" (it imports {missing!r}, which is missing)"
        raise ImportPathError(
            f"{flag} {path!r}: cannot import module {module_name!r}{where}; check the spelling "
            "and that the module is installed or on PYTHONPATH"
        ) from err
    except Exception as err:
        raise ImportPathError(
            f"{flag} {path!r}: importing module {module_name!r} failed with "
            f"{type(err).__name__}: {err}"
        ) from err
    for depth, name in enumerate(names):
        if not hasattr(target, name):
            owner = ".".join([module_name, *names[:depth]])
            public = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(name, public, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ImportPathError(f"{flag} {path!r}: {owner!r} has no attribute {name!r}{hint}")
        target = getattr(target, name)
    return target
