"""Prompts for `mlaserve bench serving`: random token sequences of exact length, or ShareGPT turns.

Input lengths are exact. Token-id prompts are exact by construction; a text prompt is decoded
from token ids and re-encoded, and where byte-level merges or split characters change the
count the ids are trimmed or topped up and tried again until the text re-tokenizes to exactly
the asked length (`exact_length_text`).
"""

import json
import random
from dataclasses import dataclass


@dataclass
class DatasetRow:
    prompt: str | list[int]     # text, or token ids where the API takes them
    prompt_len: int             # tokens, by the benchmark's tokenizer, without special tokens
    output_len: int             # tokens asked for (forced with ignore_eos)


def ordinary_token_ids(tokenizer) -> list[int]:
    """Vocabulary ids that are not special or added tokens: what random prompts are drawn from."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ids = [i for i in range(len(tokenizer)) if i not in special]
    if not ids:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no ordinary tokens to build prompts from")
    return ids


def whole_character_token_ids(tokenizer, pool: list[int]) -> list[int]:
    """The ids of `pool` that decode to whole characters: a byte-level token holding part of a
    multi-byte character decodes to U+FFFD, which re-encodes to other tokens."""
    clean = [i for i in pool if "\ufffd" not in tokenizer.decode([i])]
    return clean or pool


def exact_length_text(tokenizer, ids: list[int], target: int, pool: list[int], rng: random.Random,
                      max_tries: int = 200) -> tuple[str, list[int]]:
    """Text that encodes (without special tokens) to exactly `target` tokens, starting from `ids`.

    Merges across token boundaries change the count, so: decode, re-encode, and trim (never
    inside a character) or top up with random `pool` tokens until the count is right.
    Returns the text and its token ids.
    """
    for _ in range(max_tries):
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == target:
            return text, encoded
        if len(encoded) > target:
            ids = encoded[:target]
            while ids and tokenizer.decode(ids).endswith("\ufffd"):
                ids = ids[:-1]
        else:
            ids = encoded + [rng.choice(pool) for _ in range(target - len(encoded))]
    raise ValueError(f"could not build a text prompt of exactly {target} tokens after {max_tries} tries "
                     f"(last attempt re-tokenized to {len(encoded)}); send token ids instead (drop --prompt-as-text)")


def sample_lengths(mean_len: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    """n lengths uniform in [mean_len * range_ratio, mean_len] (SGLang's --random-range-ratio)."""
    if mean_len < 1:
        raise ValueError(f"lengths must be >= 1, got {mean_len}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(mean_len * range_ratio))
    return [rng.randint(low, mean_len) for _ in range(n)]


def sample_random_requests(tokenizer, input_len: int, output_len: int, num_prompts: int, range_ratio: float,
                           rng: random.Random, as_ids: bool, source_ids: list[int] | None = None) -> list[DatasetRow]:
    """Random prompts: windows of `source_ids` (a tokenized corpus) when given, else random vocabulary ids."""
    pool = ordinary_token_ids(tokenizer)
    if not as_ids:
        pool = whole_character_token_ids(tokenizer, pool)
    input_lens = sample_lengths(input_len, range_ratio, num_prompts, rng)
    output_lens = sample_lengths(output_len, range_ratio, num_prompts, rng)
    rows = []
    for n_in, n_out in zip(input_lens, output_lens):
        if source_ids and len(source_ids) >= n_in:
            start = rng.randrange(len(source_ids) - n_in + 1)
            ids = list(source_ids[start:start + n_in])
        else:
            ids = [rng.choice(pool) for _ in range(n_in)]
        if as_ids:
            rows.append(DatasetRow(prompt=ids, prompt_len=n_in, output_len=n_out))
        else:
            text, _ = exact_length_text(tokenizer, ids, n_in, pool, rng)
            rows.append(DatasetRow(prompt=text, prompt_len=n_in, output_len=n_out))
    return rows


def load_sharegpt(path: str) -> list[tuple[str, str]]:
    """(first human turn, first reply) pairs from a ShareGPT JSON file."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations, got {type(data).__name__}")
    pairs = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) >= 2:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ValueError(f"{path}: no conversation with two turns")
    return pairs


def sample_sharegpt_requests(path: str, num_prompts: int, tokenizer, rng: random.Random,
                             fixed_output_len: int | None = None, context_len: int | None = None) -> list[DatasetRow]:
    """ShareGPT prompts as SGLang samples them: prompt = first turn, output length = the reply's
    token count (or `fixed_output_len`); pairs with fewer than 2 tokens either side are skipped."""
    pairs = load_sharegpt(path)
    rng.shuffle(pairs)
    rows = []
    for prompt, reply in pairs:
        if len(rows) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        out_len = fixed_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < 2 or out_len < 2:
            continue
        if context_len is not None and prompt_len + out_len > context_len:
            continue
        rows.append(DatasetRow(prompt=prompt, prompt_len=prompt_len, output_len=out_len))
    if len(rows) < num_prompts:
        raise ValueError(f"{path}: only {len(rows)} usable conversations, --num-prompts is {num_prompts}")
    return rows


def sharegpt_token_stream(path: str, tokenizer, max_tokens: int) -> list[int]:
    """Concatenated tokens of ShareGPT prompts: the source of `--dataset-name random` windows."""
    ids: list[int] = []
    for prompt, _ in load_sharegpt(path):
        ids += tokenizer.encode(prompt, add_special_tokens=False)
        if len(ids) >= max_tokens:
            break
    return ids
