"""Bad requests get OpenAI-shaped 400/401/404 errors naming the problem, and the server keeps serving."""

import httpx
import pytest

from server_harness import CONTEXT_LENGTH, shared_server

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    return shared_server()


def post(server, path, body=None, raw: bytes | None = None, headers=None):
    headers = server.headers if headers is None else headers
    if raw is not None:
        return httpx.post(server.url + path, content=raw, headers={**headers, "Content-Type": "application/json"},
                          timeout=60)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def assert_error(resp, status: int, param=None, says: str = ""):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert says.lower() in err["message"].lower(), err
    assert says.lower() in err["message"].lower(), err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_still_serving(server):
    r = post(server, COMPL, {"prompt": "ok", "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path, body, param, says", [
    (COMPL, {"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    (COMPL, {"prompt": "x", "max_tokens": -5}, "max_tokens", ""),
    (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens", ""),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", ""),
    (COMPL, {"prompt": "x", "temperature": -0.5}, "temperature", "greater than or equal to 0"),
    (CHAT, {"messages": USER, "temperature": -1}, "temperature", ""),
    (COMPL, {"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    (COMPL, {"prompt": "x", "top_p": 1.5}, "top_p", "less than or equal to 1"),
    (CHAT, {"messages": []}, "messages", "at least 1"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role", ""),
    (CHAT, {}, "messages", "required"),
    (COMPL, {"max_tokens": 3}, "prompt", "required"),
    (COMPL, {"prompt": 42}, "prompt", ""),
    (COMPL, {"prompt": "x", "max_tokens": "10"}, "max_tokens", "integer"),
    (COMPL, {"prompt": "x", "temperature": "hot"}, "temperature", ""),
    (COMPL, {"prompt": "x", "stream": "yes"}, "stream", ""),
    (CHAT, {"messages": "hello"}, "messages", ""),
    (COMPL, {"prompt": "x", "n": 0}, "n", ""),
    (COMPL, {"prompt": "x", "logprobs": 99}, "logprobs", ""),
    (CHAT, {"messages": USER, "top_logprobs": 3}, "top_logprobs", "logprobs=true"),
    (COMPL, {"prompt": "x", "stop": [""]}, None, "stop"),
    (COMPL, {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    (COMPL, {"prompt": [], "max_tokens": 2}, "prompt", "empty"),
    (COMPL, {"prompt": [999999], "max_tokens": 2}, "prompt", "token ids"),
    (COMPL, {"prompt": "x", "seed": 2 ** 70}, "seed", "less than or equal"),
    (COMPL, {"prompt": "x", "min_tokens": 5, "max_tokens": 3}, None, "min_tokens"),
])
def test_bad_fields_are_400s(server, path, body, param, says):
    assert_error(post(server, path, body), 400, param, says)


@pytest.mark.parametrize("extra", [{"top_k": 100000}, {"temperature": 1e-30}, {"temperature": 1e30},
                                   {"top_p": 1e-12}, {"seed": -(2 ** 63)}, {"seed": 2 ** 63 - 1, "n": 3},
                                   {"stop": ["a" * 1000]}, {"logprobs": 20, "top_k": 3}])
def test_extreme_but_valid_values_are_served(server, extra):
    r = post(server, COMPL, {"prompt": "edge", "max_tokens": 3, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3 * extra.get("n", 1)


def test_malformed_json(server):
    for raw in (b'{"prompt": "x",', b"", b"not json", b"[1, 2]"):
        err = assert_error(post(server, COMPL, raw=raw), 400)
        assert err["type"] == "invalid_request_error"
    assert_still_serving(server)


@pytest.mark.parametrize("path", [COMPL, CHAT])
def test_unknown_model_is_404(server, path):
    body = {"model": "gpt-9", "prompt": "x"} if path == COMPL else {"model": "gpt-9", "messages": USER}
    err = assert_error(post(server, path, body), 404, "model", "gpt-9")
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_context(server, stream):
    body = {"prompt": "y" * (CONTEXT_LENGTH + 40), "max_tokens": 4, "stream": stream}
    err = assert_error(post(server, COMPL, body), 400, "prompt", f"context length {CONTEXT_LENGTH}")
    assert err["code"] == "context_length_exceeded"
    assert_error(post(server, CHAT, {"messages": [{"role": "user", "content": "z" * CONTEXT_LENGTH}],
                                     "stream": stream}), 400, "prompt", "context length")
    assert_still_serving(server)


def test_generate_bad_inputs(server):
    assert_error(post(server, "/generate", {"sampling_params": {"max_new_tokens": 2}}), 400, "text", "exactly one")
    assert_error(post(server, "/generate", {"text": "a", "input_ids": [1]}), 400, "text")
    assert_error(post(server, "/generate", {"input_ids": []}), 400, "input_ids", "empty")
    assert_error(post(server, "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 0}}), 400,
                 "sampling_params.max_new_tokens")
    assert_error(post(server, "/generate", {"text": "a", "sampling_params": {"temperature": -1}}), 400,
                 "sampling_params.temperature")
    assert_error(post(server, "/generate", {"text": ["a", "b"], "sampling_params": [{}]}), 400, "sampling_params")
    assert_error(post(server, "/generate", {"text": ["a", "b"], "rid": "one"}), 400, "rid", "must be a list of 2 ids")
    assert_error(post(server, "/generate", {"text": "a", "sampling_params": {"stop_token_ids": [-1]}}), 400,
                 "stop_token_ids")
    assert_still_serving(server)


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic dGVzdC1rZXktMTIz"}):
        for path, body in ((COMPL, {"prompt": "x", "max_tokens": 1}), (CHAT, {"messages": USER, "max_tokens": 1}),
                           ("/generate", {"text": "x"})):
            err = assert_error(post(server, path, body, headers=headers), 401, None, "api key")
            assert err["code"] == "invalid_api_key"
        r = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert r.status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers=server.headers).status_code == 200
    assert_still_serving(server)


def test_unknown_route_and_method(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing", headers=server.headers), 404, None, "not found")
    assert_error(httpx.get(f"{server.url}{COMPL}", headers=server.headers), 405)


def test_errors_mid_stream_are_events(server):
    """A stream that started has status 200; a request the engine refuses never gets that far
    (validated first), so a streamed bad request is a plain 400 too."""
    r = post(server, COMPL, {"prompt": "x", "max_tokens": 0, "stream": True})
    assert_error(r, 400, "max_tokens")
    assert_still_serving(server)
