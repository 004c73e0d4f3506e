"""`mlaserve eval gsm8k`: few-shot GSM8K accuracy against any OpenAI-compatible server.

Follows SGLang's `benchmark/gsm8k/bench_sglang.py`: the prompt is `num_shots` solved examples
("Question: …\\nAnswer: … #### N" separated by blank lines) then "Question: …\\nAnswer:";
greedy decoding (temperature 0), at most --max-new-tokens, stop strings "Question",
"Assistant:", "<|separator|>"; the prediction is the last number in the output, the label
the number after "####". Prints Accuracy, Invalid (no number in the output), Latency and
Output throughput as SGLang's script does. Requests go to `/v1/completions`, --parallel at once.

Unlike SGLang's script, the few-shot examples are never questions that are scored: they come
from --train-path, or else from the end of --data-path after the scored questions.
"""

import argparse
import asyncio
import json
import math
import re
import sys
import time

from tqdm import tqdm

from mlaserve.bench.server_info import auth_headers, base_url_of, served_model_id
from mlaserve.bench.serving_requests import client_session

INVALID = None
STOP = ["Question", "Assistant:", "<|separator|>"]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def get_answer_value(text: str) -> float | None:
    """The last number in `text` (thousands separators ignored); None when there is none."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else INVALID


def get_label(answer: str) -> float:
    """The number after "####" in a GSM8K answer."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer without '####': {answer[-80:]!r}")
    value = get_answer_value(answer.split("####")[-1])
    if value is INVALID:
        raise ValueError(f"no number after '####' in {answer[-80:]!r}")
    return value


def is_correct(pred: float | None, label: float) -> bool:
    return pred is not INVALID and math.isclose(pred, label, rel_tol=0, abs_tol=1e-6)


def format_example(row: dict, with_answer: bool) -> str:
    text = "Question: " + row["question"] + "\nAnswer:"
    return text + " " + row["answer"] if with_answer else text


def read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                if not {"question", "answer"} <= set(row):
                    raise ValueError(f"{path}:{n}: a GSM8K row needs 'question' and 'answer', got {sorted(row)}")
                rows.append(row)
    return rows


def split_questions(rows: list[dict], train: list[dict] | None, num_questions: int, num_shots: int):
    """(scored questions, few-shot examples), never overlapping."""
    if train is not None:
        if len(train) < num_shots:
            raise ValueError(f"--train-path has {len(train)} examples, --num-shots is {num_shots}")
        return rows[:num_questions], train[:num_shots]
    if len(rows) <= num_shots:
        raise ValueError(f"--data-path has {len(rows)} questions: not enough for {num_shots} shots "
                         f"plus a scored question; pass --train-path or fewer --num-shots")
    scored = rows[: min(num_questions, len(rows) - num_shots)]
    return scored, rows[len(rows) - num_shots:]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlaserve eval gsm8k", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="bearer token; default $OPENAI_API_KEY")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--data-path", default="test.jsonl", help="GSM8K JSONL of {question, answer} (a local file)")
    p.add_argument("--train-path", default=None, help="JSONL the few-shot examples come from")
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--num-questions", type=int, default=200)
    p.add_argument("--parallel", type=int, default=64, help="requests in flight")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--result-file", default=None, help="append one JSON line: the scores and every answer")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


async def ask_all(url: str, headers: dict, model: str, prompts: list[str], args) -> list[dict]:
    """Completions for every prompt: {"text", "completion_tokens"} or {"error"}."""
    semaphore = asyncio.Semaphore(args.parallel)
    pbar = tqdm(total=len(prompts), disable=args.disable_tqdm)

    async def one(session, prompt: str) -> dict:
        payload = {"model": model, "prompt": prompt, "temperature": 0.0, "max_tokens": args.max_new_tokens,
                   "stop": STOP}
        async with semaphore:
            try:
                async with session.post(url, json=payload, headers=headers) as resp:
                    body = await resp.text()
                    if resp.status != 200:
                        return {"error": f"HTTP {resp.status}: {body[:300]}"}
                    data = json.loads(body)
                    return {"text": data["choices"][0]["text"],
                            "completion_tokens": (data.get("usage") or {}).get("completion_tokens", 0)}
            except Exception as e:      # reported per question and counted; the run goes on
                return {"error": f"{type(e).__name__}: {e}"}
            finally:
                pbar.update(1)

    async with client_session() as session:
        results = await asyncio.gather(*[one(session, p) for p in prompts])
    pbar.close()
    return list(results)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.num_shots < 0 or args.num_questions < 1 or args.parallel < 1:
            raise ValueError(f"need --num-shots >= 0, --num-questions >= 1, --parallel >= 1; got "
                             f"{args.num_shots}, {args.num_questions}, {args.parallel}")
        rows = read_jsonl(args.data_path)
        train = read_jsonl(args.train_path) if args.train_path else None
        questions, shots = split_questions(rows, train, args.num_questions, args.num_shots)
        labels = [get_label(q["answer"]) for q in questions]
        base_url = base_url_of(args.base_url, args.host, args.port)
        headers = auth_headers(args.api_key)
        model = args.model or served_model_id(base_url, headers)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    few_shot = "".join(format_example(s, True) + "\n\n" for s in shots)
    prompts = [few_shot + format_example(q, False) for q in questions]

    tic = time.perf_counter()
    answers = asyncio.run(ask_all(base_url + "/v1/completions", headers, model, prompts, args))
    latency = time.perf_counter() - tic

    preds = [get_answer_value(a["text"]) if "text" in a else INVALID for a in answers]
    n = len(questions)
    accuracy = sum(is_correct(p, l) for p, l in zip(preds, labels)) / n
    invalid = sum(p is INVALID for p in preds) / n
    output_tokens = sum(a.get("completion_tokens", 0) for a in answers)
    failed = [a["error"] for a in answers if "error" in a]

    print(f"Accuracy: {accuracy:.3f}")
    print(f"Invalid: {invalid:.3f}")
    print(f"Latency: {latency:.3f} s")
    print(f"Output throughput: {output_tokens / latency:.3f} token/s")
    if failed:
        print(f"Failed requests: {len(failed)} of {n} (scored as invalid); first error: {failed[0]}")
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(json.dumps({
                "task": "gsm8k", "model": model, "num_questions": n, "num_shots": len(shots),
                "accuracy": round(accuracy, 3), "invalid": round(invalid, 3), "latency": round(latency, 3),
                "output_throughput": output_tokens / latency, "failed": len(failed),
                "answers": [{"question": q["question"], "label": l, "pred": p, "output": a.get("text"),
                             "error": a.get("error")} for q, l, p, a in zip(questions, labels, preds, answers)],
            }) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
