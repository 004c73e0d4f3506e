"""The HTTP server: OpenAI-compatible routes and SGLang's native API over the AsyncEngine.

    mlaserve serve [flags]          # launch.py; flags in args.py (SGLang's names)

app.py (state, auth, routers), openai_api.py and native_api.py (routes), protocol.py (request
bodies), generation.py (fan-out, streaming, disconnects), logprobs.py, metrics.py, errors.py.
This package's __init__ imports nothing, so that `mlaserve.server.parsers` stays free of FastAPI.
"""
