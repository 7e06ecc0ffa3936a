"""User-facing layer: run specs and their validation, the `aspen` CLI and service start-up."""
