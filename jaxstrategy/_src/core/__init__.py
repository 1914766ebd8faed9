"""The ground floor: argument and tree checks, errors, types, device names, and every private
JAX and orbax API behind one compat module each. Imports nothing else of jaxstrategy."""
