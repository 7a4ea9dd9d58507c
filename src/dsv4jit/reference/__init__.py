"""Pure-PyTorch references of the dsv4jit kernels (CPU, written from SPEC.md)."""
