"""The strategies: `Strategy`, the facade, made of a placement (one device, a replicated mesh, a
sharded mesh) and a job (this process, or a job of several); the public classes that choose the
two; `run`'s whole path; test helpers. Imports every room below it, never `checkpoint`."""
