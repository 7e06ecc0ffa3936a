"""A dry run's stand-in for the GPU machine's image (bench/gpu_lease.sh --allow-cpu puts this folder first on
PYTHONPATH, so every Python process of the run, Ray's workers too, imports this at start): the top-level modules
named in ASPEN_IMAGE_MISSING (comma-separated) cannot be imported, as there, where they are not installed and
not carried. `None` in sys.modules makes `import name` raise ModuleNotFoundError and
`importlib.util.find_spec(name)` return None, as for a module that is not installed."""

import os
import sys

for _name in filter(None, os.environ.get("ASPEN_IMAGE_MISSING", "").split(",")):
    sys.modules.setdefault(_name.strip(), None)
