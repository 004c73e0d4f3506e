"""`mlaserve serve` flags, named as SGLang names them, and the EngineConfig they make.

Only flags that work exist. The CPU page budget is SGLang's `--max-total-tokens` (the KV pool's
size in tokens); without it the engine sizes the pool itself (`--mem-fraction-static` of the free
GPU memory, or a fixed budget on the CPU).
"""

import argparse
from dataclasses import asdict, dataclass, fields

from mlaserve.engine.config import DTYPES, EngineConfig
from mlaserve.engine.kv_pool import KV_CACHE_DTYPES


# the engine's defaults are the server's: one place for each
_ENGINE = {f.name: f.default for f in fields(EngineConfig)}


@dataclass
class ServerArgs:
    model_path: str | None = None          # None: the built-in model
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    device: str | None = None              # None: cuda when available, else cpu
    dtype: str = _ENGINE["dtype"]
    attention_backend: str = _ENGINE["attention_backend"]
    nsa_prefill_backend: str | None = None
    nsa_decode_backend: str | None = None
    kv_cache_dtype: str = _ENGINE["kv_cache_dtype"]
    page_size: int = _ENGINE["page_size"]
    mem_fraction_static: float = _ENGINE["mem_fraction_static"]
    max_total_tokens: int | None = None
    max_running_requests: int = _ENGINE["max_running_requests"]
    chunked_prefill_size: int = _ENGINE["chunked_prefill_size"]
    context_length: int | None = None
    disable_radix_cache: bool = False
    random_seed: int = _ENGINE["seed"]
    tp_size: int = _ENGINE["tp_size"]      # tensor-parallel ranks (worker processes 1..N-1)
    reasoning_parser: str | None = None    # split <think>...</think> into reasoning_content (chat)
    tool_call_parser: str | None = None    # parse tool calls into OpenAI tool_calls (chat with tools)
    log_level: str = "info"

    def engine_config(self, model_path: str) -> EngineConfig:
        """The engine's config; ValueError (from EngineConfig) names any bad value."""
        num_pages = None
        if self.max_total_tokens is not None:
            # page 0 is reserved, so one page more than the tokens need
            num_pages = -(-self.max_total_tokens // self.page_size) + 1
        return EngineConfig(
            model_path=model_path, tokenizer_path=self.tokenizer_path, device=self.device, dtype=self.dtype,
            attention_backend=self.attention_backend, nsa_prefill_backend=self.nsa_prefill_backend,
            nsa_decode_backend=self.nsa_decode_backend, kv_cache_dtype=self.kv_cache_dtype, page_size=self.page_size,
            mem_fraction_static=self.mem_fraction_static, num_pages=num_pages,
            max_running_requests=self.max_running_requests, chunked_prefill_size=self.chunked_prefill_size,
            context_length=self.context_length, seed=self.random_seed,
            enable_prefix_caching=not self.disable_radix_cache, tp_size=self.tp_size)


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def make_parser(prog: str = "mlaserve serve") -> argparse.ArgumentParser:
    from mlaserve.attention import registry

    d = ServerArgs()
    backends = registry.names()
    p = argparse.ArgumentParser(prog=prog, description="Serve a model over an OpenAI-compatible HTTP API "
                                "(and SGLang's native /generate).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model-path", "--model", dest="model_path", default=d.model_path,
                   help="HF-layout model directory; default: the built-in tiny DeepSeek-V3.2 model")
    m.add_argument("--tokenizer-path", default=d.tokenizer_path, help="default: the model path")
    m.add_argument("--served-model-name", default=d.served_model_name,
                   help="the name clients send as `model`; default: the model path (or mlaserve-builtin)")
    m.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N; default: cuda when available")
    m.add_argument("--dtype", default=d.dtype, choices=["auto", *DTYPES],
                   help="auto: bfloat16 on CUDA, float32 on the CPU")
    m.add_argument("--context-length", type=_positive(int), default=d.context_length,
                   help="longest prompt + output; default: the model's max_position_embeddings")
    m.add_argument("--tensor-parallel-size", "--tp-size", "--tp", dest="tp_size", type=_positive(int),
                   default=d.tp_size, help="tensor-parallel ranks: attention heads and MLP/expert intermediate "
                   "dims split across them (NCCL on cuda:0..N-1, gloo processes on the CPU)")
    a = p.add_argument_group("attention and KV cache")
    a.add_argument("--attention-backend", default=d.attention_backend, choices=backends,
                   help="dense MLA backend")
    dsa_backends = registry.names(dsa=True)
    a.add_argument("--nsa-prefill-backend", default=d.nsa_prefill_backend, choices=dsa_backends,
                   help="DSA backend (indexer + sparse MLA) for prefill; default: the attention backend "
                        "when it has DSA kernels, else auto")
    a.add_argument("--nsa-decode-backend", default=d.nsa_decode_backend, choices=dsa_backends,
                   help="DSA backend (indexer + sparse MLA) for decode; default: as for prefill")
    a.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES))
    a.add_argument("--page-size", type=_positive(int), default=d.page_size, help="tokens per KV page")
    a.add_argument("--mem-fraction-static", type=_positive(float), default=d.mem_fraction_static,
                   help="fraction of the free GPU memory the KV pool takes")
    a.add_argument("--max-total-tokens", type=_positive(int), default=d.max_total_tokens,
                   help="KV pool size in tokens (overrides --mem-fraction-static; the page budget on the CPU)")
    a.add_argument("--disable-radix-cache", action="store_true", help="turn the prefix cache off")
    s = p.add_argument_group("scheduling")
    s.add_argument("--max-running-requests", type=_positive(int), default=d.max_running_requests)
    s.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                   help="most prompt tokens per prefill step; -1 turns chunking off")
    s.add_argument("--random-seed", type=int, default=d.random_seed, help="seed of requests that bring none")
    from mlaserve.server.parsers import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES
    o = p.add_argument_group("chat output parsing")
    o.add_argument("--reasoning-parser", default=d.reasoning_parser, choices=REASONING_PARSER_NAMES,
                   help="return the <think> block as reasoning_content")
    o.add_argument("--tool-call-parser", default=d.tool_call_parser, choices=TOOL_CALL_PARSER_NAMES,
                   help="return tool calls as tool_calls when a request brings tools")
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default=d.host)
    h.add_argument("--port", type=int, default=d.port)
    h.add_argument("--api-key", default=d.api_key,
                   help="require `Authorization: Bearer <key>` on every route but /health and /metrics")
    h.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    return p


def parse_args(argv: list[str] | None, prog: str = "mlaserve serve") -> ServerArgs:
    ns = make_parser(prog).parse_args(argv)
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in asdict(ServerArgs())})
