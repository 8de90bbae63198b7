"""The engine of the catalog deployments (test_fresh_load.py; its --engine-cmd runs this through
catalog_zygote.py): `python -m wsync`'s main with wsync-local's flags and the adapter of this
engine, chosen by its --engine-id (engine-N: the N-th of $WSYNC_CATALOG_ADAPTERS, a comma list such
as "vllm,transformers"). Runs main in this process (a fork of catalog_zygote.py's server, where
torch, transformers and vLLM are imported already), so wsync-local's signals reach the engine.

Once main returns (the engine host closed), the process leaves at once (os._exit): vLLM's
finalizers (its engine core's shutdown, with full gc passes) and the interpreter's teardown take
seconds of CPU per engine, and nothing the test checks happens after the host has closed. Its
temporary files (the vLLM adapter's model directory, which it would remove at exit; vLLM's own) are
made in the deployment's workdir (the directory of --address-file, under the test's tmp_path)."""

import os
import sys
import tempfile

adapters = os.environ["WSYNC_CATALOG_ADAPTERS"].split(",")
engine_id = sys.argv[sys.argv.index("--engine-id") + 1]
adapter = adapters[int(engine_id.rsplit("-", 1)[1])]
tempfile.tempdir = os.path.dirname(os.path.abspath(sys.argv[sys.argv.index("--address-file") + 1]))

from wsync.__main__ import main  # noqa: E402

rc = main(["--adapter", adapter, *sys.argv[1:]], prog="python -m wsync")
sys.stdout.flush()
sys.stderr.flush()
os._exit(rc)
