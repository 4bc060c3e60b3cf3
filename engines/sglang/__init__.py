"""The sglang and ktransformers backends: an SGLang server as a child process, spoken to over HTTP."""
