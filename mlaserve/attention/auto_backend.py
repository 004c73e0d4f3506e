"""`auto`: for each step, the backend measured fastest for its shape, among those that run here.

Measured on the H200 (bench/results/h200-20261130-0081d29e95a6.json and
h200-20261130-cutedsl-first.json, CUDA-graph timing, bf16 KV, page 64), DECODE steps: from 32 query
rows per request on, FlashInfer's fa3 MLA and mlaserve's CuTe DSL kernel both beat the Triton kernel
(Triton at 0.5-0.75x of FlashInfer, the CuTe DSL kernel 1.6-1.7x Triton's speed at 64-256 rows); at
16 rows all three are level (0.95-1.05x). The registry hands the decode peers that can run here in
the order measured fastest first. Peers without an FP8 cache path, DSA kernels or CUDA-graph hooks
are never asked for those: EXTEND steps, DSA layers and everything on the CPU stay with the primary
backend — triton on a GPU, torch on the CPU (where Triton would only run through its interpreter).
"""

from dataclasses import dataclass

from mlaserve.attention.base import AttentionBackend, BackendConfig
from mlaserve.attention.batch import BatchLayout, ForwardMode

# DECODE steps with at least this many query rows (heads x new tokens) per request go to a decode peer.
DECODE_PEER_MIN_ROWS = 32


@dataclass
class AutoMeta:
    backend: AttentionBackend   # the backend chosen for this step
    inner: object               # what its plan(layout) returned


class AutoBackend(AttentionBackend):
    name = "auto"

    def __init__(self, config: BackendConfig, primary: AttentionBackend,
                 decode_peers: tuple[AttentionBackend, ...] = ()):
        """primary: runs everything the peers do not; decode_peers: backends that can run this config's
        DECODE steps here, fastest first (the first one takes them all)."""
        super().__init__(config)
        self.primary = primary
        self.decode_peers = tuple(decode_peers)

    def choose(self, layout: BatchLayout) -> AttentionBackend:
        if (self.decode_peers and layout.mode is ForwardMode.DECODE
                and self.config.num_heads * max(layout.extend_lens, default=1) >= DECODE_PEER_MIN_ROWS):
            return self.decode_peers[0]
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
