"""The strategies themselves: the `Strategy` base, `OneDeviceStrategy`, the mesh base,
`MirroredStrategy`, `MultiWorkerMirroredStrategy`, and test helpers. Imports every room below
it, never `checkpoint`."""
