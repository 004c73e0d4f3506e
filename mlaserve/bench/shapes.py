"""The standard kernel-benchmark shapes and their FLOP and byte counts.

Dense MLA decode follows FlashMLA's benchmark (b 128, s_q 1/2, s_k 4k..32k, h 16..128, page 64),
sparse MLA and the DSA indexer follow DeepSeek-V3.2 (topk 2048, H_I 64, D_I 128). Sparse prefill
is one request of 4096 new tokens: q [1, 4096, h, 576], indices [1, 4096, 2048].

Counting rules (the same for every backend, so ratios compare like with like):
  dense FLOPs   = 2 * s_q * h * sum(s_k) * (d_qk + d_v)      (= 2*b*s_q*h*s_k*(576+512) at fixed lengths)
  sparse FLOPs  = 2 * tokens * h * topk * (d_qk + d_v)
  indexer FLOPs = 2 * s_q * H_I * D_I * sum(s_k)             (scoring only; top-k counted as no FLOPs)
  bytes = Q + KV rows read + O + lse: dense reads each request's cache once, sparse reads every gathered
  row (tokens * topk rows), the indexer reads q, weights, every key once and writes the int32 indices.
"""

from dataclasses import asdict, dataclass

from mlaserve.kernels import fp8_format

D_QK = fp8_format.D_QK          # 576
D_V = fp8_format.KV_LORA_RANK   # 512
PAGE_SIZE = 64
TOPK = 2048
INDEX_HEADS = 64
INDEX_DIM = 128


def kv_row_bytes(kv: str, d_qk: int = D_QK) -> int:
    """Bytes of one cached token: bf16 [d_qk] or the FP8 656-byte row."""
    if kv == "bf16":
        return 2 * d_qk
    if kv == "fp8":
        return fp8_format.PACKED_BYTES
    raise ValueError(f"kv must be 'bf16' or 'fp8', got {kv!r}")


@dataclass(frozen=True)
class DenseShape:
    """mla_decode: q [b, s_q, h, d_qk] over a paged cache of s_k tokens per request (mean when varlen)."""
    b: int
    s_q: int
    s_k: int
    h: int
    kv: str = "bf16"
    varlen: bool = False          # lengths uniform in [s_k/2, 3*s_k/2] instead of all s_k
    page_size: int = PAGE_SIZE
    d_qk: int = D_QK
    d_v: int = D_V
    suite = "dense"

    @property
    def key(self) -> str:
        return (f"b{self.b} sq{self.s_q} sk{self.s_k} h{self.h} " + ("var" if self.varlen else "fix")
                + ("" if (self.d_qk, self.d_v) == (D_QK, D_V) else f" d{self.d_qk}/{self.d_v}"))

    def flops(self, total_k: int) -> float:
        """total_k = sum of the b requests' cache lengths."""
        return 2.0 * self.s_q * self.h * total_k * (self.d_qk + self.d_v)

    def bytes(self, total_k: int, row_bytes: int | None = None, act_bytes: int = 2) -> float:
        """row_bytes: a cached token's bytes when a backend reads another layout than mlaserve's."""
        tokens = self.b * self.s_q
        row = kv_row_bytes(self.kv, self.d_qk) if row_bytes is None else row_bytes
        # DESIGN.md: bytes = Q + KV read + O (the float32 lse, 1/256 of O, is left out)
        return tokens * self.h * self.d_qk * act_bytes + total_k * row + tokens * self.h * self.d_v * act_bytes


@dataclass(frozen=True)
class SparseShape:
    """sparse_mla: q [b, s_q, h, d_qk], indices [b, s_q, topk] into a pool of s_kv tokens per request."""
    phase: str                    # "prefill" (b 1, s_q 4096) or "decode"
    b: int
    s_q: int
    s_kv: int
    h: int
    topk: int = TOPK
    kv: str = "bf16"
    page_size: int = PAGE_SIZE
    d_qk: int = D_QK
    d_v: int = D_V
    suite = "sparse"

    @property
    def key(self) -> str:
        return f"{self.phase} b{self.b} sq{self.s_q} skv{self.s_kv} topk{self.topk} h{self.h}"

    @property
    def tokens(self) -> int:
        return self.b * self.s_q

    def flops(self) -> float:
        return 2.0 * self.tokens * self.h * self.topk * (self.d_qk + self.d_v)

    def bytes(self, row_bytes: int | None = None, act_bytes: int = 2) -> float:
        t = self.tokens
        row = kv_row_bytes(self.kv, self.d_qk) if row_bytes is None else row_bytes
        return t * self.h * self.d_qk * act_bytes + t * self.topk * row + t * self.h * self.d_v * act_bytes


@dataclass(frozen=True)
class IndexerShape:
    """indexer_topk: q [b, s_q, H_I, D_I], weights [b, s_q, H_I], keys [b * s_k, D_I] paged; causal."""
    phase: str
    b: int
    s_q: int
    s_k: int
    heads: int = INDEX_HEADS
    dim: int = INDEX_DIM
    topk: int = TOPK
    page_size: int = PAGE_SIZE
    kv = "bf16"
    suite = "indexer"

    @property
    def key(self) -> str:
        return f"{self.phase} b{self.b} sq{self.s_q} sk{self.s_k} H{self.heads} D{self.dim} topk{self.topk}"

    def flops(self) -> float:
        return 2.0 * self.b * self.s_q * self.heads * self.dim * self.s_k

    def bytes(self, row_bytes: int | None = None, act_bytes: int = 2) -> float:
        t = self.b * self.s_q
        return (t * self.heads * self.dim * act_bytes + t * self.heads * 4 + self.b * self.s_k * self.dim * act_bytes
                + t * self.topk * 4)


Shape = DenseShape | SparseShape | IndexerShape


def shape_dict(shape: Shape) -> dict:
    return {"suite": shape.suite, **asdict(shape)}


def dense_shapes() -> list[DenseShape]:
    """In priority order (a time budget cuts from the end): fixed s_q 1, small batches, s_q 2, varlen."""
    out = []
    for kv in ("bf16", "fp8"):
        out += [DenseShape(128, 1, s_k, h, kv) for h in (16, 32, 64, 128) for s_k in (4096, 8192, 16384, 32768)]
    out += [DenseShape(b, 1, 32768, h, kv) for kv in ("bf16", "fp8") for h in (16, 128) for b in (1, 4, 16)]
    out += [DenseShape(128, 2, s_k, h, kv) for kv in ("bf16", "fp8") for h in (16, 32, 64, 128)
            for s_k in (4096, 8192, 16384, 32768)]
    out += [DenseShape(128, s_q, s_k, h, kv, varlen=True) for s_q in (1, 2) for kv in ("bf16", "fp8")
            for h in (16, 32, 64, 128) for s_k in (4096, 8192, 16384, 32768)]
    return out


def sparse_shapes() -> list[SparseShape]:
    out = [SparseShape("prefill", 1, 4096, s_kv, 128) for s_kv in (8192, 32768, 65536)]
    out += [SparseShape("decode", b, s_q, 32768, h, kv=kv) for kv in ("bf16", "fp8") for h in (128, 64)
            for s_q in (1, 2) for b in (128, 64)]
    return out


def indexer_shapes() -> list[IndexerShape]:
    return [IndexerShape("decode", 128, 1, 32768), IndexerShape("prefill", 1, 4096, 32768)]


def quick_shapes(suite: str) -> list[Shape]:
    """Tiny shapes that the torch reference finishes in seconds on a CPU (what the CPU test runs)."""
    if suite == "dense":
        return [DenseShape(2, 1, 256, 4), DenseShape(2, 2, 200, 4, varlen=True), DenseShape(2, 1, 256, 4, "fp8")]
    if suite == "sparse":
        return [SparseShape("prefill", 1, 16, 512, 4, topk=64), SparseShape("decode", 2, 2, 512, 4, topk=64, kv="fp8")]
    if suite == "indexer":
        return [IndexerShape("decode", 2, 1, 512, heads=4, dim=32, topk=64),
                IndexerShape("prefill", 1, 16, 512, heads=4, dim=32, topk=64)]
    raise ValueError(f"unknown suite {suite!r}")


SUITES = ("dense", "sparse", "indexer")


def standard_shapes(suite: str) -> list[Shape]:
    return {"dense": dense_shapes, "sparse": sparse_shapes, "indexer": indexer_shapes}[suite]()
