"""What users hold and pass: `PerReplica`, `ReduceOp`, variables, options, the strategy and
replica contexts, and the loss helpers. Imports only `core`."""
