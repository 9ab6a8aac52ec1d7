"""The OpenAI-compatible HTTP server (``python -m litellm_pipeline +recipe=serve``).

* :mod:`.protocol` -- the request bodies (pydantic);
* :mod:`.specs` -- bodies -> RequestSpecs (the only thing handed to the engine);
* :mod:`.responses` -- engine outputs -> OpenAI bodies and stream chunks;
* :mod:`.errors` -- the error taxonomy -> OpenAI error bodies;
* :mod:`.gate` -- 503 unless serving, body size limit, requests in flight;
* :mod:`.auth` -- ``Authorization: Bearer`` API keys -> the tenant (``conf/tenants``), 401 otherwise;
* :mod:`.fanin` -- one API request's choices as one stream;
* :mod:`.app` -- ``build_app(engine_or_async_engine, settings)``, the FastAPI app;
* :mod:`.serve` -- uvicorn, the printed URL and the SIGTERM drain.

Importing this package does not import FastAPI; the modules above do.
"""
