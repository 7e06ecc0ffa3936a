"""A function of the user's that a job calls (a GRPO reward, a generation metric), named in a jobs file as
`module:function` (a module Python can import: installed, or on PYTHONPATH) or `file.py:function` (a Python file,
relative to the jobs file; read by its path, in whichever process calls it: a trainer, a job's evaluation). A file
is the way for a function written beside the jobs file: `aspen run`'s trainers do not run in its folder."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

USER_FUNCTION_PATTERN = r"^(?:[A-Za-z_][A-Za-z0-9_.]*|[^:]+\.py):[A-Za-z_][A-Za-z0-9_]*$"
"""`module:function` or `path/to/file.py:function`."""
ALLOWED_FUNCTION_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.]*:(?:[A-Za-z_][A-Za-z0-9_]*|\*)$"
"""What a service may allow its users' jobs to name (`user_functions`): `module:function`, or `module:*`."""


class UserFunctionError(ValueError):
    """A user's function that cannot be loaded: the message says which and what to do."""


def split_reference(reference: str) -> tuple[str, str]:
    """(module or file, function name) of `module:function` / `file.py:function`."""
    where, _, name = reference.rpartition(":")
    return where, name


def is_file_reference(reference: str) -> bool:
    return split_reference(reference)[0].endswith(".py")


def with_file_resolved(reference: str, base_dir: Path) -> str:
    """A `file.py:function` whose file is relative, taken from `base_dir` (a jobs file's folder); anything else as
    it is."""
    where, name = split_reference(reference)
    if not where.endswith(".py") or Path(where).expanduser().is_absolute():
        return reference
    return f"{(base_dir / where).resolve()}:{name}"


def functions_resolved(value: Any, base_dir: Path) -> Any:
    """A spec field naming a function (a string) or several (a list), each `file.py:function` whose file is relative
    taken from `base_dir`; anything else as it is (the spec's check says what is wrong with it)."""
    if isinstance(value, str):
        return with_file_resolved(value, base_dir)
    if isinstance(value, list):
        return [with_file_resolved(item, base_dir) if isinstance(item, str) else item for item in value]
    return value


def load_user_function(reference: str, what: str) -> Callable[..., Any]:
    """The function `reference` names (`what`, e.g. "grpo.reward", says whose it is in errors). A file is loaded
    once per process and path (its module kept in sys.modules under a name of its path)."""
    where, name = split_reference(reference)
    if where.endswith(".py"):
        module = _module_of_file(Path(where).expanduser(), what, reference)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise UserFunctionError(
                f"{what} '{reference}': cannot import module '{where}' ({error}); for a file of yours, name the file "
                f"instead ({what}: {where.replace('.', '/')}.py:{name}, relative to the jobs or sweep file), else put "
                "its module on the trainers' PYTHONPATH") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UserFunctionError(f"{what} '{reference}': {where} has no function '{name}'")
    return function


def _module_of_file(path: Path, what: str, reference: str) -> Any:
    if not path.is_file():
        raise UserFunctionError(f"{what} '{reference}': file {path} does not exist")
    key = "aspen_user_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    module = sys.modules.get(key)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or spec.loader is None:
        raise UserFunctionError(f"{what} '{reference}': {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[key]
        raise UserFunctionError(f"{what} '{reference}': running {path} raised {type(error).__name__}: "
                                f"{error}") from error
    return module


def check_allowed_entry(entry: str) -> str:
    """An entry of a service's `user_functions`: `module:function` or `module:*`, never a file."""
    if not re.match(ALLOWED_FUNCTION_PATTERN, entry) or split_reference(entry)[0].endswith(".py"):
        raise ValueError(f"'{entry}' is not module:function or module:* (a service allows functions of importable "
                         "modules, not files)")
    return entry


def allowed(reference: str, allowed_functions: list[str]) -> bool:
    """Whether `reference` is one of `allowed_functions` (`module:function`, or `module:*`: any function of the
    module itself). A file (file.py:function) never is: a user names no file on the service's machine to run."""
    where, _ = split_reference(reference)
    return not where.endswith(".py") and any(entry == reference or entry == f"{where}:*" for entry in allowed_functions)


def check_reference(reference: str, what: str, choices: tuple[str, ...], signature: str) -> str:
    """A spec field naming a built-in (`choices`) or a function of the user's: its form checked (not loaded)."""
    if reference in choices or re.match(USER_FUNCTION_PATTERN, reference):
        return reference
    raise ValueError(f"'{reference}' is neither {', '.join(choices)} nor module:function or file.py:function (a "
                     f"{signature})")
