"""`colibri-stream serve`: the OpenAI-compatible HTTP API over one model (app, model thread, schemas)."""
