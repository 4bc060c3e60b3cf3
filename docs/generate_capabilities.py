"""Write docs/backends.md's table of what each backend supports from the backends' `Capabilities`
records (engines/base.py), so the table cannot drift from what the ingress enforces.

    python docs/generate_capabilities.py          # rewrite the table in docs/backends.md
    python docs/generate_capabilities.py --check  # exit 1 if it differs (tests/test_capabilities.py)
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines import BUILT_BACKENDS, engine_capabilities  # noqa: E402 - after the path above
from engines.base import Capabilities  # noqa: E402

BACKENDS_DOC = ROOT / "docs" / "backends.md"
BLOCK = re.compile(r"(<!-- capabilities:begin -->\n)(.*?)(\n<!-- capabilities:end -->)", re.S)

# Capabilities field -> the API feature it governs, as docs/backends.md names it.
FEATURE_LABELS: dict[str, str] = {
    "streaming": "`stream: true` (SSE)",
    "n": "`n` > 1",
    "seed": "`seed`",
    "stop_strings": "`stop` strings",
    "logprobs": "`logprobs` / `top_logprobs`",
    "prompt_logprobs": "`prompt_logprobs`; `echo` with `logprobs` (completions)",
    "presence_frequency_penalty": "`presence_penalty` / `frequency_penalty`",
    "min_p": "`min_p`",
    "logit_bias": "`logit_bias`",
    "lora": "LoRA adapters (model ID `<model_id>:<adapter>`)",
    "response_format": "`response_format` (`json_object`, `json_schema`), `structured_outputs`",
    "forced_tool_choice": "`tool_choice`: `required` or a named function",
    "images": "`image_url` content parts (vision-language models)",
    "scoring": "reward models (`stage: rm`), `POST /v1/score/evaluation`",
    "embedding": "embedding models (`task: embed`), `POST /v1/embeddings`",
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


def main(argv: list[str]) -> int:
    text = BACKENDS_DOC.read_text()
    if not BLOCK.search(text):
        print("docs/backends.md lacks the <!-- capabilities:begin/end --> block", file=sys.stderr)
        return 1
    new = BLOCK.sub(lambda m: m.group(1) + capabilities_table() + m.group(3), text)
    if "--check" in argv:
        if new != text:
            print("docs/backends.md's capabilities table is stale: run python docs/generate_capabilities.py",
                  file=sys.stderr)
            return 1
        return 0
    BACKENDS_DOC.write_text(new)
    print("wrote the capabilities table of docs/backends.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
