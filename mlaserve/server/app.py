"""The FastAPI application: shared state, API-key check, routers, error handlers.

    app = build_app(ServerState.create(engine, model_path, served_model_name, api_key))

Routes (see openai_api.py and native_api.py):
    POST /v1/completions, POST /v1/chat/completions, GET /v1/models      OpenAI-compatible
    POST /generate, GET /get_model_info, POST /start_profile, POST /stop_profile   SGLang's native API
    GET /health, GET /metrics                                              open even with --api-key
"""

import hmac
import time
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request

from mlaserve.server.errors import APIError, install_handlers
from mlaserve.server.logprobs import TokenTexts
from mlaserve.server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: object                 # mlaserve.engine.async_engine.AsyncEngine
    tokenizer: object
    model_path: str
    served_model_name: str
    api_key: str | None
    context_length: int
    metrics: ServerMetrics
    token_texts: TokenTexts
    created: int
    profiler: object = None        # a running torch profiler (/start_profile), else None
    reasoning_parser: str | None = None    # mlaserve.server.parsers names (--reasoning-parser)
    tool_call_parser: str | None = None    # (--tool-call-parser)

    @classmethod
    def create(cls, engine, model_path: str, served_model_name: str, api_key: str | None,
               reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> "ServerState":
        return cls(engine=engine, tokenizer=engine.tokenizer, model_path=model_path,
                   served_model_name=served_model_name, api_key=api_key,
                   context_length=engine.engine.context_length,
                   metrics=ServerMetrics(engine, served_model_name), token_texts=TokenTexts(engine.tokenizer),
                   created=int(time.time()), reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser)

    def check_model(self, name: str | None) -> None:
        """A request may name the served model, or its path, or none; anything else is a 404."""
        if name is not None and name not in (self.served_model_name, self.model_path):
            raise APIError(f"The model `{name}` does not exist; this server serves `{self.served_model_name}`",
                           status=404, param="model", code="model_not_found")


def state_of(request: Request) -> ServerState:
    return request.app.state.mlaserve


def require_api_key(request: Request) -> None:
    key = state_of(request).api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError("Invalid or missing API key: send `Authorization: Bearer <key>`", status=401,
                       code="invalid_api_key")


def build_app(state: ServerState) -> FastAPI:
    from mlaserve.server import native_api, openai_api

    app = FastAPI(title="mlaserve", docs_url=None, redoc_url=None)
    app.state.mlaserve = state
    install_handlers(app)
    app.include_router(openai_api.router, dependencies=[Depends(require_api_key)])
    app.include_router(native_api.protected, dependencies=[Depends(require_api_key)])
    app.include_router(native_api.open_routes)
    return app
