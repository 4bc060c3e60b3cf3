"""Ray Serve's own cost for one streamed request, on lmserve's topology: `python -m bench.lab.serve_floor`.

lmserve's target is at most 5 ms of time to first token (TTFT) added by serving at one stream
(docs/performance.md). This probe measures what the serving framework alone costs on this machine, so lmserve's overhead
(`python -m bench.lab.overhead`) can be split into the framework's part and lmserve's own.

It starts a private Ray cluster in the mode `lmserve serve` uses (deployments.cluster.env.
RAY_HIGH_THROUGHPUT_ENV: HAProxy -> the ingress replica's own HTTP server -> gRPC -> a second
replica) and deploys two small deployments in lmserve's layout:

- `FloorIngress`: a FastAPI app with POST /v1/chat/completions that parses the JSON body, calls
  the model deployment's streaming `generate` through a `DeploymentHandle` and answers
  Server-Sent Events in OpenAI's chunk shape (a role chunk, one content chunk, `[DONE]`);
- `FloorModel`: `generate` yields one list of one token at once (no model, no tokenizer).

`--one-hop` deploys a single deployment that answers HTTP and "generates" itself, for what
the ingress -> model hop costs. `--lmserve` deploys that one and lmserve's own direct-streaming
deployment (`DirectStreamingServer`, the real ingress code and tokenizer) over an engine that
answers at once, and sends to them in turns: the paired difference is lmserve's own code on the
path of a request, without the prefill whose spread (~30 ms) hides it in `bench.lab.overhead`.
The same load generator as `python -m bench` (bench.loadgen) sends `--rounds` requests one at a
time and prints the TTFT p50/p95 and the end-to-end latency: everything in it is framework and
HTTP, since the "model" answers in microseconds.
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

from bench.loadgen import CLIENTS, add_client_argument, chat_payload, open_chat_client, run_level
from bench.metrics import median_ci, percentile

MODEL_ID = "floor"


def _chunk(delta: dict, finish_reason=None) -> str:
    """One Server-Sent Event in OpenAI's chat-completion-chunk shape."""
    return "data: " + json.dumps({"id": "floor", "object": "chat.completion.chunk", "created": int(time.time()),
                                  "model": MODEL_ID, "choices": [
                                      {"index": 0, "delta": delta, "finish_reason": finish_reason}]}) + "\n\n"


def build_floor_app():
    """The two-deployment app (ingress -> model replica) described in the module docstring."""
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class FloorModel:
        async def generate(self, prompt: list[int]):
            yield [{"index": 0, "text": "x", "token_ids": [prompt[0] if prompt else 0]}]

    api = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class FloorIngress:
        def __init__(self, model):
            self.model = model.options(stream=True)

        @api.post("/v1/chat/completions")
        async def chat(self, request: Request):
            body = await request.json()
            stream = self.model.generate.remote([len(body["messages"][0]["content"])])
            first = await stream.__anext__()

            async def chunks():
                yield _chunk({"role": "assistant", "content": ""})
                for item in first:
                    yield _chunk({"content": item["text"]}, "length")
                async for _ in stream:
                    pass
                yield "data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")

    return FloorIngress.bind(FloorModel.bind())


def build_one_hop_app():
    """One deployment that both answers HTTP and "generates" (no handle call, no second
    replica): what serving costs without lmserve's ingress -> model hop."""
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse
    from ray import serve

    api = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class FloorOneHop:
        @api.post("/v1/chat/completions")
        async def chat(self, request: Request):
            body = await request.json()
            text = "x" * min(1, len(body["messages"][0]["content"]))

            async def chunks():
                yield _chunk({"role": "assistant", "content": ""})
                yield _chunk({"content": text}, "length")
                yield "data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")

    return FloorOneHop.bind()


def build_lmserve_app(model_dir: str):
    """lmserve's own direct-streaming deployment (`DirectStreamingServer`: FastAPI app, request
    validation, API-key check, the real chat template and tokenizer, metrics, SSE) in front of
    an engine that answers every request with one token at once. Its TTFT minus the one-hop
    floor's is lmserve's own code on the path; the in-process engine pays its engine hand-off
    as lmserve does, so this is what lmserve adds to TTFT outside the model."""
    from ray import serve

    from deployments.serve.direct_streaming import DirectStreamingServer
    from deployments.serve.model_client import InProcessClient
    from engines import engine_capabilities
    from engines.base import Engine, GenerationDelta, ModelInfo, Usage

    class InstantEngine(Engine):
        """Answers one token ("x") at once; no model behind it."""

        capabilities = engine_capabilities("huggingface")

        async def start(self) -> None:
            pass

        async def generate(self, request):
            yield GenerationDelta(text="x", num_tokens=1, finish_reason="length",
                                  usage=Usage(len(request.prompt_token_ids), 1))

        async def check_health(self) -> None:
            pass

        async def shutdown(self) -> None:
            pass

        def model_info(self) -> ModelInfo:
            return ModelInfo(max_model_len=8192, dtype="float32", device="cpu")

    class InstantDirectServer(DirectStreamingServer):
        async def __init__(self, model_id: str, engine_config: dict):
            self.engine = InstantEngine()
            await self._setup({model_id: engine_config}, {model_id: InProcessClient(self.engine)}, {})

    server = serve.deployment(serve.ingress()(InstantDirectServer), ray_actor_options={"num_cpus": 0})
    return server.bind(MODEL_ID, {"model_name_or_path": model_dir, "infer_dtype": "float32"})


async def _measure(urls: dict[str, str], rounds: int, warmup: int, client: str = CLIENTS[0]) -> dict[str, list]:
    """`rounds` requests one at a time to each app, the apps taking turns (so drift hits all
    alike), sent with HTTP client `client` (bench.loadgen.CLIENTS); records per app name."""
    records: dict[str, list] = {name: [] for name in urls}
    async with open_chat_client(client, max_connections=4, timeout_s=60) as stream:
        def sender(url):
            async def send(record, index):
                await stream(url + "/v1/chat/completions", chat_payload(MODEL_ID, "Hello there.", 1, False), record)
            return send

        senders = {name: sender(url) for name, url in urls.items()}
        for send in senders.values():
            await run_level(send, 1, warmup, 120)
        for _ in range(rounds):
            for name, send in senders.items():
                recs, _ = await run_level(send, 1, 1, 60)
                records[name].extend(recs)
    return records


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.serve_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--one-hop", action="store_true",
                        help="one deployment answers HTTP and generates (no ingress -> model call)")
    add_client_argument(parser)
    parser.add_argument("--lmserve", action="store_true",
                        help="lmserve's direct-streaming deployment with an engine that answers at once, "
                             "interleaved with the one-hop floor")
    opts = parser.parse_args()

    from deployments.cluster.env import apply_ray_high_throughput_env, second_cluster_ports_env
    from engines.sglang.server_process import free_port

    port = free_port()
    apply_ray_high_throughput_env()
    for name, value in second_cluster_ports_env(avoid=[port]).items():
        os.environ.setdefault(name, value)
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=2, include_dashboard=False,
             _temp_dir=tempfile.mkdtemp(prefix="lmfloor-"))
    url = f"http://127.0.0.1:{port}"
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        if opts.lmserve:
            from engines.model_source import ensure_embedded_model

            serve.run(build_one_hop_app(), name="floor", route_prefix="/floor")
            serve.run(build_lmserve_app(str(ensure_embedded_model())), name="lmserve", route_prefix="/")
            urls = {"one deployment (HAProxy -> replica)": url + "/floor",
                    "lmserve direct streaming, engine answering at once": url}
        else:
            serve.run(build_one_hop_app() if opts.one_hop else build_floor_app(), name="floor", route_prefix="/")
            urls = {"one deployment (HAProxy -> replica)" if opts.one_hop
                    else "lmserve's topology (HAProxy -> ingress replica -> gRPC -> model replica)": url}
        records = asyncio.run(_measure(urls, opts.rounds, opts.warmup, opts.client))
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    print(f"\nRay Serve floor, {opts.rounds} requests one at a time per app, load generator {opts.client}\n")
    print("| app | TTFT p50 ms | TTFT p95 ms | end-to-end p50 ms | failed |")
    print("|---|--:|--:|--:|--:|")
    for name, recs in records.items():
        ttfts = [r.ttft for r in recs if r.ttft is not None]
        ends = [r.end - r.start for r in recs if r.end is not None]
        failed = sum(1 for r in recs if r.error)
        if not ttfts:
            print(f"| {name} | no request succeeded: {recs[0].error if recs else ''} | | | {failed} |")
            return 1
        print(f"| {name} | {percentile(ttfts, 50) * 1e3:.2f} | {percentile(ttfts, 95) * 1e3:.2f} | "
              f"{percentile(ends, 50) * 1e3:.2f} | {failed} |")
    if len(records) == 2:
        (base_name, base), (name, recs) = records.items()
        pairs = [a.ttft - b.ttft for a, b in zip(recs, base) if a.ttft is not None and b.ttft is not None]
        lo, hi = median_ci(pairs)
        print(f"\npaired TTFT difference, {name} - {base_name}: p50 {percentile(pairs, 50) * 1e3:+.2f} ms "
              f"[95 % CI {lo * 1e3:+.2f}, {hi * 1e3:+.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
