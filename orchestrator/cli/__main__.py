"""`python -m orchestrator.cli`: the `aspen` command."""

import sys

from orchestrator.cli.main import main

sys.exit(main())
