"""Distributed datasets and iterators: sources, batches laid out per replica and placed on the
devices, the prefetch thread, iterator positions, and the agreement of processes on the end of
input. Imports `core`, `values`, `cluster` and `steps`."""
