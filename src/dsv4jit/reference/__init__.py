"""Pure-PyTorch references of the dsv4jit kernels (CPU, written from docs/contract.md)."""
