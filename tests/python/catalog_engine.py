"""The --engine-cmd of the catalog deployments (test_fresh_load.py): `python -m wsync`
with wsync-local's flags and the adapter of this engine, chosen by its --engine-id (engine-N:
the N-th of $WSYNC_CATALOG_ADAPTERS, a comma list such as "vllm,transformers"). Replaces itself
with the engine process (exec), so wsync-local's signals reach the engine."""

import os
import sys

adapters = os.environ["WSYNC_CATALOG_ADAPTERS"].split(",")
engine_id = sys.argv[sys.argv.index("--engine-id") + 1]
adapter = adapters[int(engine_id.rsplit("-", 1)[1])]
os.execv(sys.executable, [sys.executable, "-m", "wsync", "--adapter", adapter, *sys.argv[1:]])
