"""wsync from Python.

``wsync.trainer.Publisher``: a training process shares its parameters with its local wsync trainer
agent (``wsync-trainer-agent --source shm:NAME``) and asks for a sync after each optimizer step.
``wsync.engine.EngineHost`` with an adapter of ``wsync.adapters``: an engine wsync does not build
follows the syncs. See python/README.md.

``wsync.__version__`` is the installed distribution's version, which is the project's version in
the top-level CMakeLists.txt (``project(wsync VERSION ...)``, its one source: python/pyproject.toml
reads it from there); "0+unknown" where the package runs from a source tree without being installed.
"""

from importlib import metadata as _metadata

from wsync._native import WsyncError

__all__ = ["WsyncError", "__version__"]

try:
    __version__: str = _metadata.version("wsync")
except _metadata.PackageNotFoundError:
    __version__ = "0+unknown"
