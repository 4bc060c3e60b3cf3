"""The Ray Serve layer: a chat request reads `openai/` (HTTP API) -> `serve/` (replicas) -> `engines/`.

`app.build_app` and `autoscaling.QueueAwarePolicy` are public import paths (serve configs, k8s/).
"""
