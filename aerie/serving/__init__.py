"""The OpenAI-compatible endpoint, without Ray: what `serve_apps/openai_app.py` wires into Ray Serve.

- `config.py`: `ServeConfig` (the endpoint) and `CaptureConfig` (its Data Capture), validated.
- `protocol.py`: OpenAI request bodies, validated as OpenAI validates them, and its error shape.
- `responses.py`: response bodies and Server-Sent Events chunks.
- `service.py`: `OpenAIService`, one engine loop serving every request (limits, streaming,
  cancellation, logging, metrics hooks, capture).
- `records.py`: what is reported per request (metrics, the log line) and the observer interface.
- `http.py`: the FastAPI app of the routes.
- `capture.py`: capture written off the request path.
- `deploy_configs.py`: Serve configs for `serve deploy` and for Ray Serve LLM (vLLM).
"""
