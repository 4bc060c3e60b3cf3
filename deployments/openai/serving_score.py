"""`POST /v1/score/evaluation`: LLaMA-Factory's reward scores, one float per text, from a reward
model (`stage: rm`); a model that generates answers 405."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from deployments.openai.protocol import ScoreEvaluationRequest, ScoreEvaluationResponse
from deployments.serve.router import check_route, label_request
from deployments.openai.serving import OpenAIServing, json_response


class ScoreServing(OpenAIServing):
    """Serves reward scores."""

    async def score_evaluation(self, body: ScoreEvaluationRequest, request: Request) -> Response:
        """Reward scores for `body.messages`, in order (LLaMA-Factory's `ScoreEvaluationResponse`).

        Raises:
            ServingError: METHOD_NOT_ALLOWED for a model that generates; from the engine
                (a text without tokens, `max_length` too long); OVERLOADED, UNAVAILABLE, TIMEOUT.
        """
        entry = self.router.resolve(body.model)
        label_request(request, entry)
        check_route(entry, scoring=True)
        scores = await self.router.score(entry, body.messages, body.max_length)
        return json_response(ScoreEvaluationResponse(id=self.request_id(request, "scoreval"), object="score.evaluation",
                                                     model=entry.model_id, scores=scores), entry.capabilities.backend)
