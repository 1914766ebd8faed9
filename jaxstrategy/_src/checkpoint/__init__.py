"""Checkpoints: the step format, saving and restoring onto any strategy, the directory lock,
checksums, how leaves are stored, iterator positions, and preemption. The top floor: it may
import every other room, and none imports it."""
