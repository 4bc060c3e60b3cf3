"""Cache-aware routing on a real local Ray cluster (issue 39): two replicas of the default model
behind the two-hop layout, conversations whose every turn resends the history. Each turn after
the first finds its history in the replica's prefix cache, as the usage's `cached_tokens` says;
with Ray Serve's power-of-two-choices router a turn lands on the other replica about half the
time and prefills everything again. The router's choices themselves are in
test_request_router.py."""

import openai
import pytest

from conftest import TEST_API_KEY

pytestmark = pytest.mark.slow

BLOCK = 16  # the prefix cache's block, in tokens
TOPICS = ["lighthouses", "tides", "sailing knots"]


@pytest.fixture(scope="module")
def two_replicas(serve_url):
    """`/routing`: two replicas of the default model, a quarter of a CPU each (the cluster's 2 are
    shared with the session's app)."""
    from ray import serve

    from deployments.app import build_app

    app = build_app({"models": [{"model_id": "routed", "model_name_or_path": "smollm2", "deployment": {
        "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.25}}}], "api_keys": [TEST_API_KEY]})
    try:
        serve.run(app, name="routing", route_prefix="/routing")
        yield openai.OpenAI(base_url=serve_url + "/routing/v1", api_key=TEST_API_KEY, max_retries=0, timeout=300)
    finally:
        serve.delete("routing")


def test_every_turn_of_a_conversation_finds_its_history_on_the_replica_it_goes_to(two_replicas):
    for topic in TOPICS:
        messages = [{"role": "system", "content": f"You are a teacher of {topic}. " * 12}]
        previous_prompt = 0
        for turn, question in enumerate(["Tell me one fact.", "Another one?", "And a third?", "Summarize."]):
            messages.append({"role": "user", "content": f"{question} ({topic}, turn {turn + 1})"})
            answer = two_replicas.chat.completions.create(model="routed", messages=messages, temperature=0,
                                                          max_tokens=8)
            cached = answer.usage.prompt_tokens_details.cached_tokens
            # the whole earlier prompt's full blocks at least (its answer's, too, where they match)
            assert cached >= previous_prompt // BLOCK * BLOCK, (topic, turn, cached, previous_prompt)
            previous_prompt = answer.usage.prompt_tokens
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
