"""A step as one compiled program: the SPMD wrapper, which outputs are the same on every
replica, argument roles (static, donated, kept), the compiled-step cache, the in-flight bound,
and Flax NNX objects as arguments. Imports `core`, `values` and `cluster`."""
