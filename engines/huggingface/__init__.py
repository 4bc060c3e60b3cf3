"""The huggingface backend: transformers models under lmserve's continuous batcher."""
