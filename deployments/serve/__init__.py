"""The model replicas and the path to them: model server, router, streaming, drain, deployment options."""
