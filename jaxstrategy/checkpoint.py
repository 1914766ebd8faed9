"""Save and restore variable pytrees onto any strategy, atomically, with orbax.

`save` / `restore` for one checkpoint; `Checkpointer` for a training loop (saves in the
background, keeps the newest steps). Restoring reads every leaf directly onto the target
strategy's sharding, whatever strategy saved it.
"""

from jaxstrategy._src.checkpoint import Checkpointer as Checkpointer
from jaxstrategy._src.checkpoint import CheckpointMismatchError as CheckpointMismatchError
from jaxstrategy._src.checkpoint import CheckpointNotFoundError as CheckpointNotFoundError
from jaxstrategy._src.checkpoint import CorruptCheckpointError as CorruptCheckpointError
from jaxstrategy._src.checkpoint import restore as restore
from jaxstrategy._src.checkpoint import save as save

__all__ = (
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CorruptCheckpointError",
    "restore",
    "save",
)
