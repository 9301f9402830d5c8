"""`jaxtrain serve`: an OpenAI-compatible HTTP server on the generation engine (one engine
thread, worker.py; requests parsed and answered in OpenAI's shapes, protocol.py and
replies.py; the FastAPI app, app.py)."""
