"""`colibri-stream serve`: the OpenAI-compatible HTTP API over one model (app, worker, schemas)."""
