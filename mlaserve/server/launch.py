"""`mlaserve serve` / `python -m mlaserve.launch_server`: load the engine, then serve HTTP.

    mlaserve serve                                  # the built-in tiny DeepSeek-V3.2 model, port 30000
    mlaserve serve --model-path /models/DeepSeek-V3.2 --attention-backend triton --kv-cache-dtype fp8_e4m3

The engine is built before the HTTP server starts, so /health answers only once the model is
loaded. A configuration that cannot run here (no GPU, a backend that cannot run on this device,
a KV dtype the model cannot use...) stops start-up: the reason on stderr, exit status 2.
"""

import logging
import sys

from mlaserve.server.args import ServerArgs, parse_args

logger = logging.getLogger("mlaserve.server")


def build_engine(args: ServerArgs):
    """(engine, model path); ValueError / OSError when this configuration cannot run here."""
    from mlaserve.engine.async_engine import AsyncEngine
    from mlaserve.models import builtin

    model_path = args.model_path
    if model_path is None:
        model_path = builtin.ensure_builtin_model()
        logger.info("serving the built-in model from %s", model_path)
    return AsyncEngine(args.engine_config(model_path)), model_path


def main(argv: list[str] | None = None, prog: str = "mlaserve serve") -> int:
    args = parse_args(argv, prog)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine, model_path = build_engine(args)
    except (ValueError, OSError) as e:
        print(f"{prog}: cannot start: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from mlaserve.models.builtin import BUILTIN_MODEL_NAME
    from mlaserve.server.app import ServerState, build_app

    served = args.served_model_name or (BUILTIN_MODEL_NAME if args.model_path is None else args.model_path)
    state = ServerState.create(engine, model_path, served, args.api_key, args.reasoning_parser, args.tool_call_parser)
    logger.info("serving %s on http://%s:%d (KV pool: %d pages of %d tokens)", served, args.host, args.port,
                engine.stats()["pages_total"], args.page_size)
    try:
        uvicorn.run(build_app(state), host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
