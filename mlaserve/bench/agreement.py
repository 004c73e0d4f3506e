"""`mlaserve eval agreement`: do two engine configurations compute the same model?

    mlaserve eval agreement --model-path PATH \\
        --a "attention_backend=torch" --b "attention_backend=triton,kv_cache_dtype=fp8_e4m3" \\
        --max-tokens 16 --max-mean-diff 0.02 --max-abs-diff 0.3

Each configuration (`key=value,...` over EngineConfig's fields: attention_backend,
nsa_prefill_backend, nsa_decode_backend, kv_cache_dtype, dtype, device, page_size, ...; --common
applies to both) runs the same prompts with `LLM.generate(SamplingParams(max_tokens=k,
temperature=0, logprobs=True, prompt_logprobs=True, ignore_eos=True))`. Then, teacher-forced,
each scores prompt + B's greedy continuation (prompt_logprobs over the whole sequence), so both
configurations are compared on the very same tokens:

    prompt       |Δ logprob| over every prompt token but the first (from the generate runs)
    continuation |Δ logprob| over B's continuation tokens, A vs B, both teacher-forced
    greedy       the fraction of continuation positions before the first divergence of A's and
                 B's greedy tokens, and each prompt's first-divergence index (k = none)
    B decode     B's own decode-time logprobs vs A's teacher-forced ones (informational: it
                 also holds the prefill-vs-decode difference of one configuration)

Exit status 1 when the mean or max |Δ| over prompt and continuation tokens exceeds
--max-mean-diff / --max-abs-diff. The configurations run one after the other (one model in
memory at a time), with the prefix cache off unless a configuration turns it on, so every
position is computed rather than reused.
"""

import argparse
import gc
import json
import random
import sys
from dataclasses import asdict, dataclass, fields

import numpy as np

DEFAULT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs into the forest to look for something to eat.",
    "Multi-head latent attention compresses the keys and values of every token into one small latent vector.",
    "Question: A baker makes 24 muffins and sells 9. How many are left?\nAnswer:",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In 1969 the first humans landed on the Moon. The mission was called",
    "Paged KV caches split each sequence into fixed-size pages, so that memory is allocated on demand and",
    "Once upon a time",
    "Sparse attention keeps only the most relevant keys for every query: a lightning indexer scores them and",
]


def parse_config(text: str) -> dict:
    """`"k=v,k=v"` -> LLM keyword arguments; values become int, float, bool or None where they read so."""
    from mlaserve.engine.config import EngineConfig

    allowed = {f.name for f in fields(EngineConfig)} - {"model_path"}
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"configuration item {item!r} is not key=value")
        if key not in allowed:
            raise ValueError(f"unknown configuration key {key!r}; known: {sorted(allowed)}")
        out[key] = _value(value.strip())
    return out


def _value(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            continue
    return v


@dataclass
class ConfigRun:
    """What one configuration produced. Logprobs are float lists, one per prompt."""
    prompt_logprobs: list[list[float]]          # positions 1.. of each prompt
    continuation: list[list[int]]               # greedy tokens
    decode_logprobs: list[list[float]]          # logprobs of `continuation` at decode time
    scored: list[list[float]] | None = None     # teacher-forced logprobs of the reference continuation


def run_config(model_path: str, config: dict, prompts: list[list[int]], max_tokens: int,
               reference: list[list[int]] | None) -> ConfigRun:
    """Generate greedily, then score prompt + `reference` (this run's own continuation when None)."""
    import torch

    from mlaserve import LLM, SamplingParams

    llm = LLM(model_path, **config)
    try:
        gen = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
            max_tokens=max_tokens, temperature=0, logprobs=True, prompt_logprobs=True, ignore_eos=True))
        run = ConfigRun(prompt_logprobs=[o.prompt_logprobs[1:] for o in gen],
                        continuation=[o.token_ids for o in gen], decode_logprobs=[o.logprobs for o in gen])
        ref = reference if reference is not None else run.continuation
        scored = llm.generate(prompt_token_ids=[p + c for p, c in zip(prompts, ref)],
                              sampling_params=SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True))
        run.scored = [o.prompt_logprobs[len(p):] for o, p in zip(scored, prompts)]
    finally:
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return run


def abs_diffs(a: list[list[float]], b: list[list[float]]) -> np.ndarray:
    """|a - b| over all positions of all prompts, float64; lengths must match prompt by prompt."""
    for i, (x, y) in enumerate(zip(a, b)):
        if len(x) != len(y):
            raise ValueError(f"prompt {i}: {len(x)} logprobs vs {len(y)}")
    flat_a = np.array([v for x in a for v in x], dtype=np.float64)
    flat_b = np.array([v for y in b for v in y], dtype=np.float64)
    return np.abs(flat_a - flat_b)


def first_divergence(x: list[int], y: list[int]) -> int:
    """Index of the first position where the token lists differ; their common length when none does."""
    n = min(len(x), len(y))
    return next((i for i in range(n) if x[i] != y[i]), n)


def compare(a: ConfigRun, b: ConfigRun, max_tokens: int) -> dict:
    prompt_d = abs_diffs(a.prompt_logprobs, b.prompt_logprobs)
    cont_d = abs_diffs(a.scored, b.scored)
    decode_d = abs_diffs(a.scored, b.decode_logprobs)
    all_d = np.concatenate([prompt_d, cont_d])
    divergence = [first_divergence(x, y) for x, y in zip(a.continuation, b.continuation)]
    stat = lambda d: {"n": int(d.size), "mean": float(d.mean()) if d.size else 0.0,
                      "max": float(d.max()) if d.size else 0.0}
    return {
        "prompt": stat(prompt_d), "continuation": stat(cont_d), "all": stat(all_d), "b_decode_vs_a": stat(decode_d),
        "greedy_agreement": sum(divergence) / (len(divergence) * max_tokens),
        "first_divergence": divergence,
    }


def format_report(model_path: str, a_text: str, b_text: str, prompts: list[list[int]], k: int, r: dict,
                  verdict: str) -> str:
    row = lambda label, value: f"{label:<48} {value}"
    lines = [
        f"{' Logprob Agreement ':=^60}",
        row("Model:", model_path), row("Config A:", a_text or "(defaults)"), row("Config B:", b_text or "(defaults)"),
        row("Prompts:", f"{len(prompts)} ({sum(map(len, prompts))} tokens), {k} continuation tokens each"),
        f"{'Prompt tokens (teacher-forced)':-^60}",
        row("Positions compared:", r["prompt"]["n"]),
        row("Mean |Δ logprob|:", f"{r['prompt']['mean']:.3e}"), row("Max |Δ logprob|:", f"{r['prompt']['max']:.3e}"),
        f"{' B continuation scored under A and B ':-^60}",
        row("Positions compared:", r["continuation"]["n"]),
        row("Mean |Δ logprob|:", f"{r['continuation']['mean']:.3e}"),
        row("Max |Δ logprob|:", f"{r['continuation']['max']:.3e}"),
        row("B decode-time vs A teacher-forced, mean/max:",
            f"{r['b_decode_vs_a']['mean']:.3e} / {r['b_decode_vs_a']['max']:.3e}"),
        f"{' Greedy continuations ':-^60}",
        row("Agreement (positions before first divergence):", f"{r['greedy_agreement']:.4f}"),
        row("First divergence index per prompt:", r["first_divergence"]),
        f"{' All positions ':-^60}",
        row("Mean |Δ logprob|:", f"{r['all']['mean']:.3e}"), row("Max |Δ logprob|:", f"{r['all']['max']:.3e}"),
        row("Result:", verdict),
        "=" * 60,
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlaserve eval agreement", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="default: the built-in model")
    p.add_argument("--a", default="attention_backend=torch", help="configuration A: key=value,...")
    p.add_argument("--b", default="attention_backend=torch", help="configuration B: key=value,...")
    p.add_argument("--common", default="", help="key=value,... applied to both (e.g. device=cpu,dtype=float32)")
    p.add_argument("--prompts-file", default=None, help="one prompt per line (text); default: a built-in set")
    p.add_argument("--num-random-prompts", type=int, default=0, help="use this many random token-id prompts instead")
    p.add_argument("--random-prompt-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=16, help="greedy continuation length k")
    p.add_argument("--max-mean-diff", type=float, default=None, help="fail when mean |Δ logprob| exceeds this")
    p.add_argument("--max-abs-diff", type=float, default=None, help="fail when max |Δ logprob| exceeds this")
    p.add_argument("--output-file", default=None, help="write the full comparison as JSON")
    return p


def make_prompts(args, tokenizer) -> list[list[int]]:
    if args.num_random_prompts:
        from mlaserve.bench.serving_data import ordinary_token_ids

        rng = random.Random(args.seed)
        pool = ordinary_token_ids(tokenizer)
        return [[rng.choice(pool) for _ in range(args.random_prompt_len)] for _ in range(args.num_random_prompts)]
    if args.prompts_file:
        with open(args.prompts_file) as f:
            texts = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
    else:
        texts = DEFAULT_PROMPTS
    return [tokenizer(t)["input_ids"] for t in texts]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        common = parse_config(args.common)
        config_a = {"enable_prefix_caching": False, **common, **parse_config(args.a)}
        config_b = {"enable_prefix_caching": False, **common, **parse_config(args.b)}
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        if args.model_path is None:
            from mlaserve.models.builtin import ensure_builtin_model
            args.model_path = ensure_builtin_model()
        from mlaserve.models import load_tokenizer
        tokenizer = load_tokenizer(config_a.get("tokenizer_path") or args.model_path)
        prompts = make_prompts(args, tokenizer)
        if any(len(p) < 2 for p in prompts):
            raise ValueError("every prompt needs at least 2 tokens (the first token has no logprob)")
        run_b = run_config(args.model_path, config_b, prompts, args.max_tokens, reference=None)
        run_a = run_config(args.model_path, config_a, prompts, args.max_tokens, reference=run_b.continuation)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = compare(run_a, run_b, args.max_tokens)
    failures = []
    if args.max_mean_diff is not None and result["all"]["mean"] > args.max_mean_diff:
        failures.append(f"mean {result['all']['mean']:.3e} > {args.max_mean_diff}")
    if args.max_abs_diff is not None and result["all"]["max"] > args.max_abs_diff:
        failures.append(f"max {result['all']['max']:.3e} > {args.max_abs_diff}")
    checked = args.max_mean_diff is not None or args.max_abs_diff is not None
    verdict = ("FAIL: " + "; ".join(failures)) if failures else ("PASS" if checked else "not checked (no thresholds)")
    print(format_report(args.model_path, args.a, args.b, prompts, args.max_tokens, result, verdict))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump({"model_path": args.model_path, "a": config_a, "b": config_b, "max_tokens": args.max_tokens,
                       "prompts": prompts, **result, "verdict": verdict,
                       "runs": {"a": asdict(run_a), "b": asdict(run_b)}}, f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
