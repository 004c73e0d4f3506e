"""`auto`: for each step, the backend measured fastest for its shape, among those that run here.

Measured on the H200 (bench/results/h200-20261130-0081d29e95a6.json, CUDA-graph timing, bf16 KV,
page 64): for DECODE steps FlashInfer's fa3 MLA beats mlaserve's Triton kernel from 32 query rows
per request on (Triton at 0.5-0.75x of it), and the two are level at 16 rows (0.95-1.05x).
FlashInfer cannot read the FP8 cache, has no DSA kernels and no CUDA-graph hooks here, so those,
EXTEND steps and everything on the CPU stay with the primary backend: triton on a GPU, torch on
the CPU (where Triton would only run through its interpreter).
"""

from dataclasses import dataclass

from mlaserve.attention.base import AttentionBackend, BackendConfig
from mlaserve.attention.batch import BatchLayout, ForwardMode

# DECODE steps with at least this many query rows (heads x new tokens) per request go to FlashInfer.
FLASHINFER_MIN_ROWS = 32


@dataclass
class AutoMeta:
    backend: AttentionBackend   # the backend chosen for this step
    inner: object               # what its plan(layout) returned


class AutoBackend(AttentionBackend):
    name = "auto"

    def __init__(self, config: BackendConfig, primary: AttentionBackend, decode_peer: AttentionBackend | None = None):
        """primary: runs everything the peer does not; decode_peer: FlashInfer, when it can run here."""
        super().__init__(config)
        self.primary = primary
        self.decode_peer = decode_peer

    def choose(self, layout: BatchLayout) -> AttentionBackend:
        if (self.decode_peer is not None and layout.mode is ForwardMode.DECODE
                and self.config.num_heads * max(layout.extend_lens, default=1) >= FLASHINFER_MIN_ROWS):
            return self.decode_peer
        return self.primary

    def plan(self, layout: BatchLayout) -> AutoMeta:
        backend = self.choose(layout)
        return AutoMeta(backend, backend.plan(layout))

    def extend_uses_mha(self, layout: BatchLayout) -> bool:
        return self.choose(layout).extend_uses_mha(layout)

    def mla(self, q, kv_cache, layout, meta: AutoMeta, softmax_scale, head_dim_v):
        return meta.backend.mla(q, kv_cache, layout, meta.inner, softmax_scale, head_dim_v)

    def mha(self, q, k, v, layout, meta: AutoMeta, softmax_scale):
        return meta.backend.mha(q, k, v, layout, meta.inner, softmax_scale)

    def indexer_topk(self, q, weights, k_cache, layout, meta: AutoMeta, topk):
        return self._dsa(meta).indexer_topk(q, weights, k_cache, layout, meta.inner, topk)

    def sparse_mla(self, q, kv_cache, indices, layout, meta: AutoMeta, softmax_scale, head_dim_v):
        return self._dsa(meta).sparse_mla(q, kv_cache, indices, layout, meta.inner, softmax_scale, head_dim_v)

    def _dsa(self, meta: AutoMeta) -> AttentionBackend:
        # the registry builds DSA autos without a decode peer, so every step's choice is the primary
        if meta.backend is not self.primary:
            raise RuntimeError(f"auto chose {meta.backend.name!r} for this step, which has no DSA kernels")
        return self.primary
