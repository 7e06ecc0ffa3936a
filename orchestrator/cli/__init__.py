"""The `aspen` command line: `serve`, `submit`, `status`, `cancel`, `stop` talk to a service on a Ray
cluster; `run`, `sweep` and `demo` start their own service and wait for it; `export` writes an adapter for
serving engines. One module per group of commands, the parser in one place, the entry point `main`."""

from orchestrator.cli.main import main

__all__ = ["main"]
