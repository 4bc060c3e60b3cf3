"""The OpenAI-compatible HTTP API: ingress app, request/response schema, routes, SSE, errors, web chat."""
