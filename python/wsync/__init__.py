"""wsync from Python.

``wsync.trainer.Publisher``: a training process shares its parameters with its local wsync trainer
agent (``wsync-trainer-agent --source shm:NAME``) and asks for a sync after each optimizer step.
See python/README.md.
"""

from wsync._native import WsyncError

__all__ = ["WsyncError"]
__version__ = "0.1.0"
