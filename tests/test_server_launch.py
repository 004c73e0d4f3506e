"""`mlaserve serve`: flags, start time with the built-in model, and start-up refusals that say why."""

import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from mlaserve.server.args import ServerArgs, parse_args
from server_harness import REPO, launch_command, server_env, shared_server

SGLANG_FLAGS = ["--model-path", "--attention-backend", "--nsa-prefill-backend", "--nsa-decode-backend",
                "--kv-cache-dtype", "--page-size", "--mem-fraction-static", "--max-running-requests",
                "--chunked-prefill-size", "--api-key", "--host", "--port", "--device", "--dtype",
                "--served-model-name", "--context-length", "--disable-radix-cache", "--random-seed",
                "--max-total-tokens"]


def test_help_lists_sglang_flags(capsys):
    from mlaserve import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in SGLANG_FLAGS:
        assert flag in text, flag
    assert "torch" in text      # backend choices come from the attention registry


def test_flags_make_the_engine_config():
    args = parse_args(["--page-size", "16", "--max-total-tokens", "100", "--disable-radix-cache",
                       "--attention-backend", "torch", "--nsa-decode-backend", "torch", "--random-seed", "7",
                       "--chunked-prefill-size", "-1", "--context-length", "512", "--device", "cpu"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 30000, None)
    cfg = args.engine_config("/some/model")
    assert cfg.num_pages == 7 + 1                # ceil(100 / 16) usable pages + the reserved page 0
    assert cfg.enable_prefix_caching is False and cfg.seed == 7 and cfg.chunked_prefill_size is None
    assert (cfg.attention_backend, cfg.nsa_prefill_backend, cfg.nsa_decode_backend) == ("torch", "torch", "torch")
    assert cfg.context_length == 512 and cfg.page_size == 16 and cfg.model_path == "/some/model"
    assert ServerArgs().engine_config("/m").num_pages is None      # the engine sizes the pool itself


def test_builtin_model_starts_fast():
    """The shared server was started on a fresh cache: the start includes building the model."""
    server = shared_server()
    assert server.start_seconds < 30, f"start took {server.start_seconds:.1f} s"
    assert (Path(server.cache_dir) / "builtin-1" / "model.safetensors").is_file()


def test_builtin_model_answers_at_several_tokens_per_second():
    server = shared_server()
    start = time.perf_counter()
    r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=120, json={
        "prompt": "How fast are you?", "max_tokens": 32, "temperature": 0, "ignore_eos": True})
    seconds = time.perf_counter() - start
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32
    assert 32 / seconds > 3, f"{32 / seconds:.1f} tokens/s"


REFUSALS = [
    (["--kv-cache-dtype", "fp8_e4m3"], "kv_lora_rank=512"),
    (["--attention-backend", "flashinfer"], "flashinfer"),
    (["--context-length", "100000"], "max_position_embeddings"),
    (["--model-path", "/nonexistent/model"], "/nonexistent/model"),
]
if not torch.cuda.is_available():
    REFUSALS.append((["--device", "cuda"], "cuda"))


@pytest.mark.parametrize("args, says", REFUSALS)
def test_unrunnable_configurations_stop_startup_with_the_reason(args, says, tmp_path, monkeypatch, capsys):
    import uvicorn

    from mlaserve.server import launch

    monkeypatch.setenv("MLASERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail(f"{args} started a server"))
    assert launch.main(args) == 2
    err = capsys.readouterr().err
    assert says.lower() in err.lower() and "cannot start" in err, err


@pytest.mark.parametrize("args, says", [(["--attention-backend", "no-such-backend"], "invalid choice"),
                                        (["--page-size", "0"], "must be > 0")])
def test_bad_flags_are_usage_errors(args, says, capsys):
    from mlaserve.server import launch

    with pytest.raises(SystemExit) as exit_info:
        launch.main(args)
    assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_refusal_through_the_real_command(tmp_path):
    """The command itself: non-zero exit status, the reason on stderr, no traceback."""
    cmd = launch_command(["--kv-cache-dtype", "fp8_e4m3", "--port", "1"])
    proc = subprocess.run(cmd, env=server_env(str(tmp_path)), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc
    assert "kv_lora_rank=512" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
