"""`mlaserve generate [--model-path DIR] --prompt TEXT [--prompt TEXT ...] [--max-tokens N] ...`

Offline generation through the LLM API; prints each prompt's completion. Without
--model-path it runs the small built-in model (made on first use). Engine flags use SGLang's
names, as `mlaserve serve` does.
"""

import argparse
import sys
import time

from mlaserve.attention import registry


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlaserve generate", description=__doc__.split("\n\n")[1])
    p.add_argument("--model-path", default=None, help="HF-layout model directory (default: the built-in model)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--attention-backend", default="auto", choices=registry.names())
    p.add_argument("--nsa-prefill-backend", default=None, choices=registry.names(dsa=True))
    p.add_argument("--nsa-decode-backend", default=None, choices=registry.names(dsa=True))
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--max-total-pages", type=int, default=None, help="KV pool size in pages (default: from memory)")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--chunked-prefill-size", type=int, default=8192, help="-1 turns chunking off")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--disable-radix-cache", action="store_true", help="turn the prefix cache off")
    p.add_argument("--random-seed", type=int, default=0, help="seed of unseeded sampling")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mlaserve.engine.llm import LLM
    from mlaserve.engine.sampling_params import SamplingParams
    if args.model_path is None:
        from mlaserve.models.builtin import ensure_builtin_model
        args.model_path = ensure_builtin_model()
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
        llm = LLM(args.model_path, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                  kv_cache_dtype=args.kv_cache_dtype, page_size=args.page_size,
                  nsa_prefill_backend=args.nsa_prefill_backend, nsa_decode_backend=args.nsa_decode_backend,
                  mem_fraction_static=args.mem_fraction_static, num_pages=args.max_total_pages,
                  max_running_requests=args.max_running_requests, chunked_prefill_size=args.chunked_prefill_size,
                  context_length=args.context_length, enable_prefix_caching=not args.disable_radix_cache,
                  seed=args.random_seed)
        if args.chat:
            ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"] for p in args.prompt]
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=ids, sampling_params=params) if args.chat \
            else llm.generate(args.prompt, params)
        elapsed = time.perf_counter() - t0
    except ValueError as e:
        print(f"mlaserve generate: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outs):
        print(f"--- prompt: {prompt!r}")
        print(out.text)
        print(f"--- {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
    n = sum(len(o.token_ids) for o in outs)
    print(f"{n} tokens in {elapsed:.2f} s ({n / max(elapsed, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0
