"""dsv4jit: JIT-compiled CUDA kernels for the DeepSeek-V4 KV compressor."""
__version__ = "0.1.0"
