"""The `flashinfer` attention backend: FlashInfer's Hopper (fa3) MLA kernel as a peer to measure against.

FlashInfer's `BatchMLAPagedAttentionWrapper(workspace, backend="fa3")` computes absorbed MLA over a
paged latent cache: `plan(...)` is host work (CSR paging, work partition, JIT build on first use),
`run(...)` only launches. Version 0.7.2.post1 takes structural inputs: `query=(q_nope, q_pe)` and
`kv_cache=(ckv, kpe)`, which here are views into mlaserve's `[T, h, 576]` queries and
`[pages, page_size, 576]` cache (no copies). `FlashInferMLA` is that thin adapter; the benchmark uses
it directly, and with `page_size=1` (one "page" per cache slot, each query token its own request
whose pages are its top-k slots) it computes sparse MLA exactly, as SGLang's fa3 DSA backend does.

Dense bf16/fp16 KV only: FlashInfer has no reader for mlaserve's 656-byte FP8 rows.
"""

import importlib
import importlib.util
from dataclasses import dataclass

import torch

from mlaserve.attention.base import AttentionBackend, BackendConfig
from mlaserve.attention.batch import BatchLayout

# FlashInfer's documented starting point for the float workspace (split-KV partial results).
WORKSPACE_BYTES = 128 * 1024 * 1024
HEAD_DIM_CKV = 512
HEAD_DIM_KPE = 64
_DTYPES = (torch.bfloat16, torch.float16)


def _import_flashinfer_mla():
    """flashinfer.mla, imported on first use (importing it costs seconds and needs CUDA-side packages)."""
    try:
        return importlib.import_module("flashinfer.mla")
    except Exception as e:   # a broken install fails in many ways (missing .so, CUDA mismatch): all mean "cannot use"
        raise ImportError(f"cannot import flashinfer.mla ({type(e).__name__}: {e}); "
                          f"pip install flashinfer-python") from e


def unavailable_reason(device: torch.device | str, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                       head_dim_ckv: int = HEAD_DIM_CKV, head_dim_kpe: int = HEAD_DIM_KPE) -> str | None:
    """None when FlashInfer's fa3 MLA can run these shapes here, else why not (cheap checks first)."""
    if importlib.util.find_spec("flashinfer") is None:
        return "the `flashinfer` package is not installed (pip install flashinfer-python)"
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"FlashInfer's fa3 MLA runs on a CUDA Hopper GPU (SM90); got device {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"FlashInfer's fa3 MLA needs Hopper (SM90), found SM{major}{minor}"
    if kv_cache_dtype != "auto":
        return (f"kv_cache_dtype={kv_cache_dtype!r}: FlashInfer cannot read mlaserve's FP8 656-byte KV rows "
                f"(its FP8 MLA wants an e4m3 k_pe with a per-tensor scale); use kv_cache_dtype='auto'")
    if dtype not in _DTYPES:
        return f"FlashInfer's MLA takes bf16/fp16 activations, got {dtype}"
    if (head_dim_ckv, head_dim_kpe) != (HEAD_DIM_CKV, HEAD_DIM_KPE):
        return (f"mlaserve drives FlashInfer's MLA only at kv_lora_rank={HEAD_DIM_CKV}, rope={HEAD_DIM_KPE}; "
                f"got {head_dim_ckv}/{head_dim_kpe}")
    try:
        _import_flashinfer_mla()
    except ImportError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class CsrPaging:
    """FlashInfer's CSR description of a batch (all int32, on cpu).

    Request i owns query rows qo_indptr[i]:qo_indptr[i+1] and pages
    kv_indices[kv_indptr[i]:kv_indptr[i+1]], which hold its kv_lens[i] tokens (ceil(len / page_size) pages).
    """
    qo_indptr: torch.Tensor    # on cpu, int32 [b + 1]
    kv_indptr: torch.Tensor    # on cpu, int32 [b + 1]
    kv_indices: torch.Tensor   # on cpu, int32 [total pages]
    kv_lens: torch.Tensor      # on cpu, int32 [b]

    @staticmethod
    def from_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
                         page_size: int) -> "CsrPaging":
        """block_table int32 [b, max_pages]; seq_lens int32 [b] (tokens incl. new); q_lens int32 [b] new tokens."""
        block_table, seq_lens, q_lens = block_table.cpu(), seq_lens.cpu().long(), q_lens.cpu().long()
        pages = (seq_lens + page_size - 1) // page_size                          # [b]
        used = torch.arange(block_table.shape[1])[None, :] < pages[:, None]      # [b, max_pages]
        return CsrPaging(qo_indptr=_indptr(q_lens), kv_indptr=_indptr(pages),
                         kv_indices=block_table[used].to(torch.int32).contiguous(),
                         kv_lens=seq_lens.to(torch.int32))

    @staticmethod
    def from_sparse_indices(indices: torch.Tensor) -> "CsrPaging":
        """indices int32 [T, topk] slot ids (-1 unused) -> one request per query token, page_size 1."""
        indices = indices.cpu()
        valid = indices >= 0
        counts = valid.sum(dim=1)                                                # [T]
        return CsrPaging(qo_indptr=_indptr(torch.ones_like(counts)), kv_indptr=_indptr(counts),
                         kv_indices=indices[valid].to(torch.int32).contiguous(), kv_lens=counts.to(torch.int32))


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(counts, 0)
    return out


class FlashInferMLA:
    """One `BatchMLAPagedAttentionWrapper(backend="fa3")` with its workspace: plan (host), then run (launch)."""

    def __init__(self, device: torch.device | str, workspace_bytes: int = WORKSPACE_BYTES):
        self._fi = _import_flashinfer_mla()
        self.device = torch.device(device)
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrapper = self._fi.BatchMLAPagedAttentionWrapper(self._workspace, backend="fa3")
        self.head_dim_ckv = HEAD_DIM_CKV

    def plan(self, paging: CsrPaging, *, num_heads: int, page_size: int, causal: bool, sm_scale: float,
             dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
             head_dim_ckv: int = HEAD_DIM_CKV, head_dim_kpe: int = HEAD_DIM_KPE) -> None:
        """Host work: FlashInfer's scheduler partitions the batch (and JIT-builds its module on first use)."""
        self.head_dim_ckv = head_dim_ckv
        metadata = self._fi.MLAPlanMetadata.csr(paging.qo_indptr, paging.kv_indptr, paging.kv_indices,
                                                paging.kv_lens)
        self._wrapper.plan(metadata=metadata, num_heads=num_heads, head_dim_ckv=head_dim_ckv,
                           head_dim_kpe=head_dim_kpe, page_size=page_size, causal=causal,
                           sm_scale=float(sm_scale), q_data_type=dtype,
                           kv_data_type=dtype if kv_dtype is None else kv_dtype,
                           query_layout="split", kv_cache_layout="split", lse_mode="basee")

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, h, 576]; kv_cache [pages, page_size, 576] -> out [T, h, 512] (q's dtype), lse float32 [T, h] (ln)."""
        dc = self.head_dim_ckv
        return self._wrapper.run(query=(q[..., :dc], q[..., dc:]), kv_cache=(kv_cache[..., :dc], kv_cache[..., dc:]),
                                 return_lse=True, return_lse_base_on_e=True)

    def run_split(self, q: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, **scales):
        """Like `run` with the cache given as two tensors (FlashInfer's own FP8 layout: e4m3 ckv [pages, ps, 512]
        with `ckv_scale_arr` float32 [pages, ps, 4], e4m3 kpe [pages, ps, 64] with a per-tensor `kpe_scale`)."""
        dc = self.head_dim_ckv
        return self._wrapper.run(query=(q[..., :dc], q[..., dc:]), kv_cache=(ckv, kpe),
                                 return_lse=True, return_lse_base_on_e=True, **scales)


@dataclass
class FlashInferMeta:
    """What `FlashInferBackend.plan` returns for one step."""
    paging: CsrPaging                  # on cpu
    planned_scale: float | None        # the softmax scale the wrapper is planned with; None: not planned yet


class FlashInferBackend(AttentionBackend):
    """Dense absorbed MLA (decode and extend, causal) through FlashInfer's fa3 kernel; bf16/fp16 KV.

    FlashInfer fixes the softmax scale at plan time, and `plan(layout)` is not given it: pass
    `softmax_scale=` at construction to plan fully in `plan()`; otherwise the first `mla()` call of a step
    plans (host work once per step, shared by all layers).
    """
    name = "flashinfer"
    supports_cuda_graph = False

    @staticmethod
    def unavailable_reason(config: BackendConfig) -> str | None:
        return unavailable_reason(config.device, config.dtype, config.kv_cache_dtype,
                                  config.kv_lora_rank, config.qk_rope_head_dim)

    def __init__(self, config: BackendConfig, softmax_scale: float | None = None,
                 workspace_bytes: int = WORKSPACE_BYTES):
        super().__init__(config)
        reason = self.unavailable_reason(config)
        if reason is not None:
            raise ValueError(f"attention backend 'flashinfer' cannot run here: {reason}")
        self.softmax_scale = softmax_scale
        self._mla = FlashInferMLA(config.device, workspace_bytes)

    def extend_uses_mha(self, layout: BatchLayout) -> bool:
        return False   # FlashInfer's MLA wrapper runs the absorbed form for extend steps too (causal plan)

    def plan(self, layout: BatchLayout) -> FlashInferMeta:
        table = torch.zeros(layout.batch_size, max(len(bt) for bt in layout.block_tables), dtype=torch.int32)
        for i, bt in enumerate(layout.block_tables):
            table[i, :len(bt)] = torch.tensor(bt, dtype=torch.int32)
        paging = CsrPaging.from_block_table(table, torch.tensor(layout.seq_lens, dtype=torch.int32),
                                            torch.tensor(layout.extend_lens, dtype=torch.int32), layout.page_size)
        meta = FlashInferMeta(paging=paging, planned_scale=None)
        if self.softmax_scale is not None:
            self._plan(meta, self.softmax_scale, layout.page_size)
        return meta

    def _plan(self, meta: FlashInferMeta, softmax_scale: float, page_size: int) -> None:
        self._mla.plan(meta.paging, num_heads=self.config.num_heads, page_size=page_size, causal=True,
                       sm_scale=softmax_scale, dtype=self.config.dtype,
                       head_dim_ckv=self.config.kv_lora_rank, head_dim_kpe=self.config.qk_rope_head_dim)
        meta.planned_scale = softmax_scale

    def mla(self, q, kv_cache, layout, meta, softmax_scale, head_dim_v):
        """q [T, h, 576]; kv_cache [pages, page_size, 576] -> o_lat [T, h, 512] in q's dtype."""
        if head_dim_v != self.config.kv_lora_rank:
            raise ValueError(f"flashinfer MLA gives head_dim_v = kv_lora_rank = {self.config.kv_lora_rank}, "
                             f"asked for {head_dim_v}")
        if kv_cache.dtype == torch.uint8:
            raise ValueError("flashinfer cannot read mlaserve's FP8 KV rows; build it with kv_cache_dtype='auto'")
        if meta.planned_scale != softmax_scale:
            self._plan(meta, softmax_scale, layout.page_size)
        out, _ = self._mla.run(q, kv_cache)
        return out
