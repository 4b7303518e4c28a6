"""The OpenAI-compatible HTTP server: routes (api.py), request/response shapes (protocol.py, formats.py,
responses.py), errors for clients (errors.py), Prometheus metrics, the serving loop and its launcher."""
