"""Messages -> prompt token ids: the renderer, LLaMA-Factory templates, tool formats, tool-call parsing, media."""
