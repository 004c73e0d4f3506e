"""`mlaserve eval gsm8k`: scoring on known outputs, and a whole run against the fake server."""

import json
from pathlib import Path

import pytest

from mlaserve.bench import gsm8k
from tools_fake_server import FakeServer, make_tokenizer

MINI = str(Path(__file__).parent / "data" / "gsm8k_mini.jsonl")


@pytest.mark.parametrize("text,value", [
    ("He has 42 - 30 = 12 left.\n#### 12", 12.0),
    ("The tank holds 1,500 liters, so the answer is 1,500.", 1500.0),
    ("Change: 20 - 11.75 = 8.25 dollars.", 8.25),
    ("It dropped to -7 degrees.", -7.0),
    ("3 apples and then 13", 13.0),
    ("I am not sure.", None),
    ("", None),
])
def test_answer_value(text, value):
    assert gsm8k.get_answer_value(text) == value


def test_labels_and_correctness():
    rows = gsm8k.read_jsonl(MINI)
    assert len(rows) == 12
    assert [gsm8k.get_label(r["answer"]) for r in rows][:3] == [12.0, 210.0, 9.0]
    assert gsm8k.get_label(rows[7]["answer"]) == 8.25 and gsm8k.get_label(rows[9]["answer"]) == -7.0
    assert gsm8k.is_correct(12.0, 12.0) and not gsm8k.is_correct(12.5, 12.0) and not gsm8k.is_correct(None, 12.0)
    with pytest.raises(ValueError, match="without '####'"):
        gsm8k.get_label("just 12")


def test_few_shot_examples_are_never_scored(tmp_path):
    rows = gsm8k.read_jsonl(MINI)
    scored, shots = gsm8k.split_questions(rows, None, num_questions=200, num_shots=5)
    assert len(scored) == 7 and len(shots) == 5
    assert not {r["question"] for r in scored} & {r["question"] for r in shots}
    scored, shots = gsm8k.split_questions(rows, rows[:2], num_questions=3, num_shots=2)
    assert scored == rows[:3] and shots == rows[:2]
    with pytest.raises(ValueError, match="has 12 questions: not enough for 12 shots"):
        gsm8k.split_questions(rows, None, 5, 12)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="needs 'question' and 'answer'"):
        gsm8k.read_jsonl(str(bad))


def test_end_to_end_on_the_mini_file(capsys, tmp_path):
    rows = gsm8k.read_jsonl(MINI)
    scored = rows[:7]
    answers = {r["question"]: r["answer"] for r in scored[:4]}          # 4 right (stop must cut what follows)
    answers[scored[4]["question"]] = "So the answer is 999.\n#### 999"   # 1 wrong
    answers[scored[5]["question"]] = "I do not know."                    # 1 invalid; scored[6]: letters only -> invalid
    server = FakeServer(make_tokenizer(str(tmp_path / "tok")), answers=answers).start()
    result = tmp_path / "gsm8k.jsonl"
    try:
        rc = gsm8k.main(["--base-url", server.url, "--data-path", MINI, "--num-shots", "5", "--parallel", "3",
                         "--max-new-tokens", "400", "--result-file", str(result), "--disable-tqdm"])
    finally:
        server.stop()
    out = capsys.readouterr().out
    assert rc == 0
    assert "Accuracy: 0.571\n" in out and "Invalid: 0.286\n" in out
    assert "Latency: " in out and "Output throughput: " in out and "token/s" in out
    assert len(server.payloads) == 7
    for p in server.payloads:
        assert p["temperature"] == 0.0 and p["stop"] == ["Question", "Assistant:", "<|separator|>"]
        assert p["prompt"].count("Question: ") == 6 and p["prompt"].endswith("\nAnswer:")
        assert p["prompt"].startswith("Question: " + rows[7]["question"] + "\nAnswer: " + rows[7]["answer"] + "\n\n")
    record = json.loads(result.read_text())
    assert [a["pred"] for a in record["answers"]][:6] == [12.0, 210.0, 9.0, 55.0, 999.0, None]
    assert all("Question" not in a["output"] for a in record["answers"])


def test_failed_requests_are_reported(capsys, tmp_path):
    server = FakeServer(make_tokenizer(str(tmp_path / "tok")), fail_every=2).start()
    try:
        rc = gsm8k.main(["--base-url", server.url, "--data-path", MINI, "--num-shots", "2", "--num-questions", "4",
                         "--disable-tqdm"])
    finally:
        server.stop()
    out = capsys.readouterr().out
    assert rc == 1 and "Failed requests: 2 of 4" in out and "injected failure" in out
    assert gsm8k.main(["--data-path", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
