"""The OpenAI-compatible HTTP server: `openai_api.build_app(engine_client, ...)` and
`serve.run_server(...)`.

The package itself imports nothing: the engine process's fork server imports
`loom.server.engine_core` (the engine, torch) and should not pay for the HTTP front end
(FastAPI, pydantic models) it never runs.
"""
