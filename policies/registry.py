"""Finding a policy by name: a built-in name, `module:Class`, or a Python entry point in the group
`aspen.policies` (so third parties ship policies as packages)."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

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
            installed = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
            raise ValueError(f"unknown policy '{name}': built-in policies are {', '.join(sorted(builtins))}; "
                             f"installed entry points ({ENTRY_POINT_GROUP}): {', '.join(installed) or 'none'}; "
                             "or give 'module:Class'")
        cls = found[0].load()
    policy = cls()
    if not isinstance(policy, Policy):
        raise TypeError(f"policy '{name}' ({cls!r}) has no `name` attribute and `decide(snapshot)` method")
    return policy
