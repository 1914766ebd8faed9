"""Private implementation of jaxstrategy. Nothing here is API; import from `jaxstrategy`."""
