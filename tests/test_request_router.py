"""Cache-aware routing (deployments/serve/request_router.py): the prefix index, the router's
choices on fake replicas (no Ray cluster), the session header's way from HTTP to the handle,
and the deployments' default. The routing on a real cluster is in test_routing_cluster.py."""

import asyncio
import time

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest
from ray.serve.config import RequestRouterConfig
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from conftest import backend_config
from deployments.app import model_deployment_options
from deployments.openai.middleware import SessionIdMiddleware
from deployments.serve.deployment_defaults import (
    POWER_OF_TWO_ROUTER,
    PREFIX_AFFINITY_ROUTER,
    ROUTING_STATS_PERIOD_S,
)
from deployments.serve.model_client import SESSION_ID, ReplicaClient
from deployments.serve.request_router import (
    REPORT_GRACE_S,
    PrefixAffinityIndex,
    PrefixAffinityRouter,
    rendezvous_replica,
)
from engines import BUILT_BACKENDS
from engines.base import GenerationRequest, MediaInput

DEPLOYMENT = DeploymentID(name="ModelServer:m", app_name="lmserve")
SYSTEM = list(range(1000, 1064))  # a 64-token shared prefix (4 blocks)


# ---- the index --------------------------------------------------------------------------

def test_the_index_finds_the_replicas_with_the_longest_prefix():
    index = PrefixAffinityIndex()
    a, b = "a", "b"
    index.record(a, index.hashes(SYSTEM + list(range(64))))
    index.record(b, index.hashes(SYSTEM + list(range(500, 532))))
    assert index.longest(index.hashes(SYSTEM + list(range(64)) + [7] * 20), {a, b}) == ({a}, 8)
    assert index.longest(index.hashes(SYSTEM + [9] * 40), {a, b}) == ({a, b}, 4)  # the shared system prompt
    assert index.longest(index.hashes(SYSTEM + list(range(64))), {b}) == ({b}, 4)  # a among the candidates only
    assert index.longest(index.hashes([5] * 64), {a, b}) == (set(), 0)
    # one token off inside the first block: nothing matches past it
    assert index.longest(index.hashes([0] + SYSTEM[1:]), {a, b}) == (set(), 0)
    # another adapter's prompt of the same tokens is another prefix
    assert index.longest(index.hashes(SYSTEM, namespace="sft"), {a, b}) == (set(), 0)


def test_the_index_is_bounded_and_evicts_the_deepest_blocks_first():
    index = PrefixAffinityIndex(max_blocks=10)
    index.record("a", index.hashes(SYSTEM))  # 4 blocks
    for i in range(5):  # 5 conversations of 4 more blocks each after the shared 4: 24 blocks
        index.record("a", index.hashes(SYSTEM + [i] * 64))
    assert len(index) == 10
    # the shared prefix, touched by every request, is kept; the oldest conversations went
    assert index.longest(index.hashes(SYSTEM), {"a"})[1] == 4
    assert index.longest(index.hashes(SYSTEM + [4] * 64), {"a"})[1] == 8
    assert index.longest(index.hashes(SYSTEM + [0] * 64), {"a"})[1] == 4


def test_the_index_forgets_replicas_that_left_and_bounds_sessions():
    index = PrefixAffinityIndex(max_sessions=2)
    index.record("a", index.hashes(SYSTEM), session_id="s1")
    index.record("b", index.hashes(SYSTEM), session_id="s2")
    index.record("b", [], session_id="s3")
    assert index.session_replica("s1") is None  # least recently used session went
    assert index.session_replica("s3") == "b"
    index.remove({"b"})
    assert index.session_replica("s3") is None
    assert index.longest(index.hashes(SYSTEM), {"a", "b"}) == ({"a"}, 4)
    index.remove({"a"})
    assert len(index) == 0


# ---- the router on fake replicas --------------------------------------------------------

class FakeReplica:
    """What Ray's request router reads of a `RunningReplica`."""

    def __init__(self, name: str, queue_len: int = 0):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats: dict = {}
        self.max_ongoing_requests = 16
        self.node_id = ""
        self.availability_zone = None
        self.queue_len = queue_len

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def pending(tokens: list[int], *, session_id: str = "", request_id: str = "r", lora_name: str | None = None,
            media: MediaInput | None = None, multiplexed_model_id: str = "") -> PendingRequest:
    request = GenerationRequest(request_id=request_id, prompt_token_ids=tokens, lora_name=lora_name, media=media)
    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id, session_id=session_id,
                               multiplexed_model_id=multiplexed_model_id)
    return PendingRequest(args=[request], kwargs={}, metadata=metadata)


def new_router(replicas) -> PrefixAffinityRouter:
    """A router with default kwargs over `replicas`, as Ray makes one in a handle's process."""
    router = PrefixAffinityRouter(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=False, self_node_id="node", self_availability_zone=None,
        prefer_local_node_routing=False, prefer_local_az_routing=False,
        create_replica_wrapper_func=lambda info: info)
    router.initialize_state()
    router.update_replicas(replicas)
    return router


def route(coroutine_fn):
    """Run a test body with a router of 3 fake replicas, in an event loop as Ray runs it."""
    def run():
        async def body():
            replicas = [FakeReplica(name) for name in ("r0", "r1", "r2")]
            router = new_router(replicas)
            await coroutine_fn(router, replicas)
        asyncio.run(body())
    run.__name__ = coroutine_fn.__name__
    return run


async def ranks(router: PrefixAffinityRouter, replicas, request: PendingRequest) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in await router.choose_replicas(replicas, request)]


@route
async def test_a_prompt_whose_prefix_a_replica_saw_goes_there_first(router, replicas):
    first = pending(SYSTEM + list(range(40)), request_id="1")
    assert len(cold := await ranks(router, replicas, first)) == 1 and len(cold[0]) == 2  # power of two choices
    router.on_request_routed(first, replicas[1].replica_id, None)
    # the chat's next turn: the whole first prompt and more
    follow_up = pending(SYSTEM + list(range(40)) + list(range(300, 350)), request_id="2")
    got = await ranks(router, replicas, follow_up)
    assert got[0] == ["r1"] and len(got) == 2  # then power of two choices, if r1 is full
    # a prompt sharing only the system prompt also prefers r1 (64 of 80 tokens match)
    assert (await ranks(router, replicas, pending(SYSTEM + [7] * 16)))[0] == ["r1"]
    # too little of the prompt matches (64 of 700 tokens < 10 %), or another adapter: no preference
    assert len(await ranks(router, replicas, pending(SYSTEM + [7] * 636))) == 1
    assert len(await ranks(router, replicas, pending(SYSTEM + list(range(40)), lora_name="sft"))) == 1


@route
async def test_a_session_stays_on_its_replica_whatever_its_prompt(router, replicas):
    first = pending([1] * 40, session_id="chat-7", request_id="1")
    router.on_request_routed(first, replicas[2].replica_id, None)
    assert (await ranks(router, replicas, pending([9] * 40, session_id="chat-7")))[0] == ["r2"]
    # a session it has not routed: its rendezvous replica, whatever replica holds its prompt
    router.on_request_routed(pending(SYSTEM, request_id="2"), replicas[0].replica_id, None)
    home = rendezvous_replica("chat-8", {r.replica_id for r in replicas}).unique_id
    assert (await ranks(router, replicas, pending(SYSTEM, session_id="chat-8")))[0] == [home]


def test_rendezvous_hashing_spreads_sessions_and_moves_only_a_leaving_replicas():
    replicas = {f"replica-{k}" for k in range(4)}
    homes = {f"s{i}": rendezvous_replica(f"s{i}", replicas) for i in range(400)}
    assert all(60 <= list(homes.values()).count(r) <= 140 for r in replicas)  # about 100 each
    after = {s: rendezvous_replica(s, replicas - {"replica-3"}) for s in homes}
    assert {s for s in homes if after[s] != homes[s]} == {s for s in homes if homes[s] == "replica-3"}


def test_two_ingress_replicas_send_a_new_session_to_the_same_model_replica():
    """Each ingress replica has its own router and index: a conversation whose turns reach
    different ingress replicas still lands on one model replica, with no state shared; without
    a session ID, the two would pick by power of two choices, each on its own."""
    async def body():
        replicas = [FakeReplica(name) for name in ("r0", "r1", "r2", "r3")]
        routers = [new_router(replicas) for _ in range(2)]
        for k in range(20):
            turn = pending(SYSTEM + [k] * 20, session_id=f"chat-{k}")
            picks = [(await ranks(router, replicas, turn))[0] for router in routers]
            assert picks[0] == picks[1] and len(picks[0]) == 1, k
        # the session's home, loaded well above the others, is passed over
        home = rendezvous_replica("chat-0", {r.replica_id for r in replicas})
        for i in range(5):
            routers[0].on_request_routed(pending(SYSTEM, request_id=f"busy{i}"), home, None)
        assert len(await ranks(routers[0], replicas, pending(SYSTEM + [0] * 20, session_id="chat-0"))) == 1

    asyncio.run(body())


@route
async def test_a_loaded_replica_loses_its_preference_until_its_requests_complete(router, replicas):
    for i in range(5):  # 5 requests in flight on r0, none elsewhere: more than imbalanced_threshold (4) above
        router.on_request_routed(pending(SYSTEM + [i] * 16, request_id=f"busy{i}"), replicas[0].replica_id, None)
    assert router.in_flight[replicas[0].replica_id] == 5
    assert len(await ranks(router, replicas, pending(SYSTEM + [0] * 16))) == 1
    router.on_request_completed(replicas[0].replica_id, "busy0")
    router.on_request_completed(replicas[0].replica_id, "busy0")  # twice: counted once
    router.on_request_completed(replicas[1].replica_id, "busy1")  # not where it went: ignored
    assert router.in_flight[replicas[0].replica_id] == 4
    assert (await ranks(router, replicas, pending(SYSTEM + [0] * 16)))[0] == ["r0"]


@route
async def test_requests_the_index_cannot_name_are_routed_by_power_of_two_choices(router, replicas):
    tokens = SYSTEM + [3] * 16
    router.on_request_routed(pending(tokens), replicas[0].replica_id, None)
    image = MediaInput(images=[object()], placeholder_prompt_ids=tokens)
    assert len(await ranks(router, replicas, pending(tokens, media=image))) == 1
    assert len(await ranks(router, replicas, pending(tokens, multiplexed_model_id="m:sft"))) == 1
    other = PendingRequest(args=[["a text to score"], None], kwargs={}, metadata=RequestMetadata("s", "s"))
    assert len(await ranks(router, replicas, other)) == 1
    router.on_request_routed(other, replicas[0].replica_id, None)  # not counted, not indexed
    assert router.in_flight[replicas[0].replica_id] == 1


@route
async def test_a_replica_that_left_is_forgotten(router, replicas):
    router.on_request_routed(pending(SYSTEM, session_id="s"), replicas[0].replica_id, None)
    router.update_replicas(replicas[1:])
    # the session goes where rendezvous hashing puts it among the replicas left
    home = rendezvous_replica("s", {r.replica_id for r in replicas[1:]}).unique_id
    assert (await ranks(router, replicas[1:], pending(SYSTEM, session_id="s")))[0] == [home]
    assert len(await ranks(router, replicas[1:], pending(SYSTEM))) == 1  # and SYSTEM's prefix is forgotten
    assert replicas[0].replica_id not in router.in_flight
    router.on_request_completed(replicas[0].replica_id, "r")  # a late completion of the gone replica


def test_router_kwargs_are_checked():
    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)
    router.initialize_state(imbalanced_threshold=0, match_rate_threshold=0.5)
    with pytest.raises(ValueError, match="unknown request_router_kwargs"):
        router.initialize_state(imbalance=3)
    with pytest.raises(ValueError, match="match_rate_threshold"):
        router.initialize_state(match_rate_threshold=2)


# ---- the session header, HTTP to handle -------------------------------------------------

def test_the_session_header_reaches_the_models_handle():
    seen = []

    class Handle:
        def __init__(self, session_id: str = ""):
            self.session_id = session_id
            self.generate = self

        def options(self, *, stream: bool = False, session_id: str = ""):
            return Handle(session_id or self.session_id)

        def remote(self, request):
            seen.append(self.session_id)
            return Stream()

    class Stream:
        def __aiter__(self):
            return self

        async def __anext__(self):
            raise StopAsyncIteration

        def cancel(self):
            pass

    client = ReplicaClient(Handle())

    async def endpoint(request):
        async for _ in client.generate(GenerationRequest(request_id="x", prompt_token_ids=[1])):
            pass
        return PlainTextResponse(SESSION_ID.get())

    app = SessionIdMiddleware(Starlette(routes=[Route("/", endpoint)]))
    with TestClient(app) as http:
        assert http.get("/", headers={"x-session-id": "conversation-1"}).text == "conversation-1"
        assert http.get("/").text == ""
    assert seen == ["conversation-1", ""]
    assert SESSION_ID.get() == ""


# ---- the deployments' default -----------------------------------------------------------

@pytest.mark.parametrize("backend", BUILT_BACKENDS)
def test_every_model_deployment_routes_by_prefix_unless_told_otherwise(backend):
    opts = model_deployment_options("m", backend_config(backend), {})
    config = RequestRouterConfig(**opts["request_router_config"])
    assert config.request_router_class == PREFIX_AFFINITY_ROUTER
    # the class Ray imports from the string
    from ray._common.utils import import_attr
    assert import_attr(PREFIX_AFFINITY_ROUTER) is PrefixAffinityRouter
    assert config.request_routing_stats_period_s == ROUTING_STATS_PERIOD_S  # a replica's adapters, fresh
    off = {"request_router_config": {"request_router_class": POWER_OF_TWO_ROUTER}}
    assert model_deployment_options("m", backend_config(backend), off)["request_router_config"] == {
        "request_router_class": POWER_OF_TWO_ROUTER, "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}


def test_direct_streaming_replicas_have_no_request_router():
    """A direct-streaming deployment is the ingress: HAProxy (or Ray's proxy) picks its replica,
    and Ray refuses a custom request router on an ingress behind HAProxy. The default is left
    out; a user's is refused, naming the option."""
    from deployments.app import direct_streaming_options
    from engines.config import ConfigError

    opts, _ = direct_streaming_options("m", backend_config("huggingface"), {})
    assert "request_router_config" not in opts
    with pytest.raises(ConfigError, match="request_router_config does not apply with direct_streaming"):
        direct_streaming_options("m", backend_config("huggingface"), {"request_router_config": {
            "request_router_class": POWER_OF_TWO_ROUTER}})


@route
async def test_an_adapters_requests_go_to_the_replicas_that_hold_it(router, replicas):
    """Adapters loaded at run time (`lora_modules_path`): a replica reports those it holds in its
    routing stats, and the router remembers where it sent each; with no prefix to follow, a
    request for an adapter goes there first."""
    replicas[2].routing_stats = {"lora_adapters": ["customer-7"]}
    assert (await ranks(router, replicas, pending([5] * 200, lora_name="customer-7")))[0] == ["r2"]
    router.on_request_routed(pending([6] * 200, lora_name="customer-9"), replicas[0].replica_id, None)
    assert (await ranks(router, replicas, pending([7] * 200, lora_name="customer-9")))[0] == ["r0"]
    assert len(await ranks(router, replicas, pending([7] * 200, lora_name="customer-1"))) == 1
    router.update_replicas(replicas[1:])
    assert len(await ranks(router, replicas[1:], pending([7] * 200, lora_name="customer-9"))) == 1


@route
async def test_an_adapters_holder_keeps_its_preference_longer_than_a_prefix_does(router, replicas):
    """A miss on an adapter costs its load elsewhere and an eviction there: the replicas holding
    it stay preferred up to `adapter_imbalanced_threshold` (8) requests above the least loaded,
    where a prefix match gives way at `imbalanced_threshold` (4)."""
    replicas[0].routing_stats = {"lora_adapters": ["customer-7"]}
    for i in range(6):  # 6 in flight on r0, none elsewhere
        router.on_request_routed(pending([i] * 40, request_id=f"busy{i}"), replicas[0].replica_id, None)
    assert len(await ranks(router, replicas, pending([0] * 40))) == 1  # its prefix: passed over
    assert (await ranks(router, replicas, pending([9] * 200, lora_name="customer-7")))[0] == ["r0"]
    for i in range(6, 9):  # 9 in flight: more than 8 above
        router.on_request_routed(pending([i] * 40, request_id=f"busy{i}"), replicas[0].replica_id, None)
    assert len(await ranks(router, replicas, pending([9] * 200, lora_name="customer-7"))) == 1
    router.initialize_state(adapter_imbalanced_threshold=4)
    with pytest.raises(ValueError, match="adapter_imbalanced_threshold"):
        router.initialize_state(adapter_imbalanced_threshold=-1)


@route
async def test_a_replica_that_reports_without_an_adapter_is_no_longer_its_holder(router, replicas):
    """Issue 37: the router remembered every replica it ever sent an adapter's request to, so an
    adapter a replica had evicted kept its requests going there (and the popular adapters ended
    up on every replica, evicting the rest). A replica's routing stats taken after the request
    reached it (`REPORT_GRACE_S`) are the truth: it holds the adapter, is serving it, or not."""
    router.on_request_routed(pending([6] * 200, lora_name="customer-9"), replicas[0].replica_id, None)
    sent = time.time()
    replicas[0].routing_stats = {"lora_adapters": ["other"], "reported_at": sent}  # taken as the request went
    assert (await ranks(router, replicas, pending([7] * 200, lora_name="customer-9")))[0] == ["r0"]
    replicas[0].routing_stats = {"lora_adapters": ["other"], "lora_adapters_in_flight": ["customer-9"],
                                 "reported_at": sent + REPORT_GRACE_S + 1}
    assert (await ranks(router, replicas, pending([7] * 200, lora_name="customer-9")))[0] == ["r0"]
    replicas[0].routing_stats = {"lora_adapters": ["other"], "reported_at": sent + REPORT_GRACE_S + 2}  # evicted
    assert len(await ranks(router, replicas, pending([7] * 200, lora_name="customer-9"))) == 1


@route
async def test_an_adapters_holders_come_before_a_prefix_seen_elsewhere(router, replicas):
    """The adapter's prompts share a system prompt (the chat template's): r1 saw it for the
    adapter, then evicted the adapter; r2 holds it now. r2 first, where the prefix rule used to
    send it back to r1 (a load and an eviction there). Among holders, the prefix decides."""
    prompt = SYSTEM + [8] * 8
    router.on_request_routed(pending(prompt, lora_name="customer-7", request_id="old"), replicas[1].replica_id, None)
    router.on_request_completed(replicas[1].replica_id, "old")
    replicas[1].routing_stats = {"lora_adapters": ["customer-1"], "reported_at": time.time() + REPORT_GRACE_S + 1}
    replicas[2].routing_stats = {"lora_adapters": ["customer-7"], "reported_at": time.time()}
    assert (await ranks(router, replicas, pending(prompt, lora_name="customer-7")))[0] == ["r2"]
    replicas[0].routing_stats = {"lora_adapters": ["customer-7"], "reported_at": time.time()}
    router.on_request_routed(pending(prompt, lora_name="customer-7", request_id="r0"), replicas[0].replica_id, None)
    router.on_request_completed(replicas[0].replica_id, "r0")
    assert (await ranks(router, replicas, pending(prompt + [9] * 30, lora_name="customer-7")))[0] == ["r0", "r2"]


def test_a_model_replica_reports_the_adapters_it_holds_and_serves(tmp_path):
    """`ModelServer.record_routing_stats`: `{}` while it has no adapter loaded at run time (the
    stats do not change, so the controller does not broadcast them); an adapter of a request
    being generated is in flight (loading it, or waiting for a slot); configured adapters and
    the base model are not reported."""
    from fake_engine import FakeEngine, Reply

    from deployments.serve.model_server import ModelServer
    from engines.config import EngineConfig

    store = tmp_path / "store"
    store.mkdir()
    config = EngineConfig(model_name_or_path="fake", lora_modules_path=str(store))
    engine = FakeEngine(Reply(choices=[["a", "b", "c"]], delay_s=0.05), config=config)

    async def body():
        server = ModelServer.__new__(ModelServer)
        await server.__init__("m", config, engine=engine)
        assert await server.record_routing_stats() == {}
        stream = server.generate(GenerationRequest(request_id="1", prompt_token_ids=[1, 2], lora_name="cust-1"))
        await stream.__anext__()
        stats = await server.record_routing_stats()
        assert stats["lora_adapters"] == [] and stats["lora_adapters_in_flight"] == ["cust-1"]
        assert abs(stats["reported_at"] - time.time()) < 5
        async for _ in stream:
            pass
        assert await server.record_routing_stats() == {}
        async for _ in server.generate(GenerationRequest(request_id="2", prompt_token_ids=[1], lora_name="base")):
            assert await server.record_routing_stats() == {}
        engine.loaded_adapters = lambda: ["cust-1"]
        assert (await server.record_routing_stats())["lora_adapters"] == ["cust-1"]
        await server.__del__()
    asyncio.run(body())
