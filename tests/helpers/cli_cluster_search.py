"""The `aspen` command as on a machine where Ray's search for a running cluster (the address file of the last
`ray start`, then any GCS process on the machine) finds none, or only the one at $FOUND_CLUSTER (an address):
`python tests/helpers/cli_cluster_search.py ARGS` is `aspen ARGS` so.

For the commands that answer once a run has ended (no cluster named): with address "auto" Ray connects to any
cluster it sees on the machine, and the test workers' clusters run beside each other, one of them with an aspen
service at times: `aspen status add` then asked that service, which had no job 'add' (exit 2, seen with three
workers). Only the search is replaced; connecting, the service calls and the fallback are the command's own."""

from __future__ import annotations

import os
import sys

import ray._private.services as services

FOUND = {os.environ["FOUND_CLUSTER"]} if os.environ.get("FOUND_CLUSTER") else set()


def search(*_args) -> set[str]:
    return set(FOUND)


search.cache_clear = lambda: None   # Ray clears the search's cache around ray.init
services.find_gcs_addresses = search
services.find_bootstrap_address = lambda temp_dir: None

if __name__ == "__main__":
    from orchestrator.cli.main import main

    sys.exit(main())
