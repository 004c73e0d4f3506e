"""What the client tools ask a running server before they start: its URL, key, model and tokenizer.

The tokenizer comes from `--tokenizer` or else from the path the server reports: SGLang's
`GET /get_model_info` (`tokenizer_path` / `model_path`), then vLLM's `GET /v1/models`
(`data[0].root`, else `data[0].id`). mlaserve's server reports its model directory the same ways.
"""

import json
import os
import urllib.error
import urllib.request


def base_url_of(base_url: str | None, host: str, port: int) -> str:
    return (base_url or f"http://{host}:{port}").rstrip("/")


def auth_headers(api_key: str | None = None) -> dict:
    key = api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def get_json(url: str, headers: dict, timeout: float = 30.0) -> dict:
    """GET a JSON document; raises RuntimeError naming the URL and status on failure."""
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"GET {url}: HTTP {e.code}: {e.read()[:300]!r}") from e
    except urllib.error.URLError as e:
        raise RuntimeError(f"GET {url}: {e.reason} (is the server running?)") from e


def served_model_id(base_url: str, headers: dict) -> str:
    data = get_json(base_url + "/v1/models", headers).get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def tokenizer_path_from_server(base_url: str, headers: dict) -> str:
    candidates = []
    try:
        info = get_json(base_url + "/get_model_info", headers)
        candidates += [info.get("tokenizer_path"), info.get("model_path")]
    except RuntimeError:
        pass    # not an SGLang-style server: /v1/models below is the fallback, and its error is the one reported
    models = get_json(base_url + "/v1/models", headers).get("data") or []
    if models:
        candidates += [models[0].get("root"), models[0].get("id")]
    candidates = [c for c in candidates if c]
    for c in candidates:
        if os.path.isdir(c):
            return c
    if candidates:
        return candidates[0]      # a hub name: transformers resolves it (or says why not)
    raise RuntimeError(f"{base_url} reports no model path; pass --tokenizer")


def load_tokenizer_for(base_url: str, headers: dict, tokenizer: str | None):
    """(tokenizer, its path): `tokenizer` if given, else the served model's."""
    from transformers import AutoTokenizer

    path = tokenizer or tokenizer_path_from_server(base_url, headers)
    try:
        return AutoTokenizer.from_pretrained(path), path
    except (OSError, ValueError) as e:
        raise RuntimeError(f"cannot load the tokenizer from {path!r} ({e}); pass --tokenizer PATH") from e
