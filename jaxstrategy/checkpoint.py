"""Save and restore variable pytrees onto any strategy, atomically, with orbax.

`save` / `restore` for one checkpoint; `Checkpointer` for a training loop (saves in the
background, keeps the newest steps). Restoring reads every leaf directly onto the target
strategy, whatever strategy saved it (onto its sharding, or on `ShardedStrategy` onto each leaf's
own layout, `strategy.layout_of`), and checks every array shard and JSON item
against the CRC32C saved with it. A save locks its directory until it is on disk, so that a
second writer is refused (`CheckpointLockedError`) rather than losing saves. A `DistributedIterator`
in the tree saves and restores its position. `PreemptionHandler` saves a training loop when the
job is told to stop (SIGTERM), and ends it with the status `PREEMPTED_EXIT_CODE`.
"""

from jaxstrategy._src.checkpoint.checkpointer import Checkpointer as Checkpointer
from jaxstrategy._src.checkpoint.checkpointer import restore as restore
from jaxstrategy._src.checkpoint.checkpointer import save as save
from jaxstrategy._src.checkpoint.format import CheckpointMismatchError as CheckpointMismatchError
from jaxstrategy._src.checkpoint.format import CheckpointNotFoundError as CheckpointNotFoundError
from jaxstrategy._src.checkpoint.format import CorruptCheckpointError as CorruptCheckpointError
from jaxstrategy._src.checkpoint.lock import CheckpointLockedError as CheckpointLockedError
from jaxstrategy._src.checkpoint.preemption import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
from jaxstrategy._src.checkpoint.preemption import PreemptionHandler as PreemptionHandler

__all__ = (
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CorruptCheckpointError",
    "PREEMPTED_EXIT_CODE",
    "PreemptionHandler",
    "restore",
    "save",
)
