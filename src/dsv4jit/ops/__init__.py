"""The public ops. CUDA tensors run the kernels; CPU tensors run the torch references (same results
within the precision contract), so the API works on a machine without a GPU.

Each public op checks its arguments, unpacks the plan and allocates its output, then calls one
custom op (library.py) that takes only tensors and scalars: what torch.compile records. One module
per family, importing downwards only:

* ``common``: what they share (device rule, dtype names, the state-pool view, error wording);
* ``online``: the online c128 compressor (``compress_forward(..., is_online=True)``);
* ``store``: ``compress_norm_rope_store``;
* ``compress``: ``compress_forward`` (the ring compressors; hands ``is_online=True`` to ``online``);
* ``fused``: ``compress_and_store``, built on the other three;
* ``layer``: ``compress_and_store_c4_layer``, a c4 layer's two compressors in one launch;
* ``online_mtp``: online c128's speculative-decoding ops (draft states, pending lengths, commit);
* ``low_ratio``: the DeepSeek-V4.1 ratio-1 and ratio-2 compressors; ``c2_pool``: ratio-2 decode pooling alone.

Each family module has the function that picks a call's kernel variant (``kernel``) and its
``Family``, from which ``dsv4jit.warmup`` derives what a model configuration reaches.
"""

from .c2_pool import c2_decode_pool
from .compress import compress_forward
from .fused import compress_and_store
from .layer import compress_and_store_c4_layer
from .low_ratio import c1_decode_norm_rope_store, c2_decode_norm_rope_store, c2_prefill_norm_rope_store
from .online_mtp import (
    online_c128_mtp_commit_pending,
    online_c128_mtp_mark_pending,
    online_c128_mtp_write_prefix_states,
)
from .store import compress_norm_rope_store

__all__ = ["c1_decode_norm_rope_store", "c2_decode_norm_rope_store", "c2_decode_pool", "c2_prefill_norm_rope_store",
           "compress_and_store", "compress_and_store_c4_layer", "compress_forward", "compress_norm_rope_store",
           "online_c128_mtp_commit_pending", "online_c128_mtp_mark_pending", "online_c128_mtp_write_prefix_states"]
