"""The JIT layer: registry (what exists) -> toolchain/cache/build (how) -> loader (load on use)."""
