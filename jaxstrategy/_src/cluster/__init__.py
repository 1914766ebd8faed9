"""The job around a strategy: cluster resolvers, JAX's coordination service, ending every
process when one ends, and local jobs for tests. Imports only `core`."""
