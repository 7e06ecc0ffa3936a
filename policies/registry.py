"""Finding a policy by name: a built-in name, `module:Class`, or a Python entry point in the group
`aspen.policies` (so third parties ship policies as packages)."""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points

from policies.base import Policy

ENTRY_POINT_GROUP = "aspen.policies"


def builtin_policies() -> dict[str, type]:
    from policies.fifo import FifoPolicy
    from policies.minpad import MinPadPolicy
    from policies.ordering import AdaptivePolicy, PriorityPolicy, SjfPolicy

    return {"fifo": FifoPolicy, "sjf": SjfPolicy, "priority": PriorityPolicy, "adaptive": AdaptivePolicy,
            "minpad": MinPadPolicy}


def load_policy(name: str) -> Policy:
    """Instantiate the policy called `name`; errors list what is available."""
    builtins = builtin_policies()
    if name in builtins:
        return builtins[name]()
    if ":" in name:
        module_name, _, class_name = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"policy '{name}': cannot import {class_name} from {module_name}: {error}") from error
    else:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            raise ValueError(f"unknown policy '{name}': {_available(builtins)}")
        cls = _load_entry_point(found[0], builtins)
    try:
        policy = cls()
    except Exception as error:   # plug-in code: say whose constructor failed, and how
        raise ValueError(f"policy '{name}': {cls.__module__}.{cls.__qualname__}() raised {error!r}; fix it (or its "
                         f"settings), or choose another policy: {_available(builtins)}") from error
    if not isinstance(policy, Policy):
        raise TypeError(f"policy '{name}' ({cls!r}) has no `name` attribute and `decide(snapshot)` method")
    return policy


def _available(builtins: dict[str, type]) -> str:
    installed = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
    return (f"built-in policies are {', '.join(sorted(builtins))}; installed entry points ({ENTRY_POINT_GROUP}): "
            f"{', '.join(installed) or 'none'}; or give 'module:Class'")


def _load_entry_point(entry: EntryPoint, builtins: dict[str, type]) -> type:
    """The class an installed policy's entry point names; a ValueError naming the entry point and its package where
    it cannot be loaded (its module does not import, or has no such class)."""
    try:
        return entry.load()
    except Exception as error:   # plug-in code: say which entry point of which package failed, and how
        package = f"{entry.dist.name} {entry.dist.version}" if entry.dist is not None else "an unknown package"
        raise ValueError(f"policy '{entry.name}': its entry point ({ENTRY_POINT_GROUP}) '{entry.name} = {entry.value}' "
                         f"of the package {package} cannot be loaded: {error!r}; reinstall or fix that package, or "
                         f"choose another policy: {_available(builtins)}") from error
