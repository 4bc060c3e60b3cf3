"""What each built backend supports, as docs/backends.md's table: made from the backends'
`Capabilities` records, so the table cannot drift from what the ingress enforces
(tests/test_capabilities.py compares docs/backends.md with `capabilities_table()`)."""

from __future__ import annotations

import dataclasses

from engines import BUILT_BACKENDS, engine_capabilities
from engines.base import Capabilities

# Capabilities field -> the API feature it governs, as docs/backends.md names it.
FEATURE_LABELS: dict[str, str] = {
    "streaming": "`stream: true` (SSE)",
    "n": "`n` > 1",
    "seed": "`seed`",
    "stop_strings": "`stop` strings",
    "logprobs": "`logprobs` / `top_logprobs`",
    "presence_frequency_penalty": "`presence_penalty` / `frequency_penalty`",
    "min_p": "`min_p`",
    "logit_bias": "`logit_bias`",
    "lora": "LoRA adapters (model ID `<model_id>:<adapter>`)",
    "response_format": "`response_format`: `json_object`, `json_schema`",
    "forced_tool_choice": "`tool_choice`: `required` or a named function",
    "images": "`image_url` content parts (vision-language models)",
    "scoring": "reward models (`stage: rm`), `POST /v1/score/evaluation`",
    "tools_in_template": "`tools` rendered by the chat template",
}


def capabilities_table(backends: tuple[str, ...] = BUILT_BACKENDS) -> str:
    """A Markdown table, one row per `Capabilities` field, one column per backend ("yes"/"no").

    Raises:
        KeyError: a `Capabilities` field without a label in `FEATURE_LABELS`.
    """
    fields = [f.name for f in dataclasses.fields(Capabilities) if f.name != "backend"]
    caps = {backend: engine_capabilities(backend) for backend in backends}
    lines = ["| feature | " + " | ".join(f"`{b}`" for b in backends) + " |",
             "|---|" + "---|" * len(backends)]
    for name in fields:
        cells = ["yes" if getattr(caps[b], name) else "no" for b in backends]
        lines.append(f"| {FEATURE_LABELS[name]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
