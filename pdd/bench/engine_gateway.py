"""``EngineGateway``: the gateway's request life over one in-process engine — no routing, no stages.

The accuracy-parity run (``eval_parity``) serves the same OpenAI API over it, so the reference
it compares every pipeline with is our engine alone behind the same HTTP face. Life of a request:
``generate(job)`` → the engine loop's mailbox for the request → ``add_request`` → each
``StepOutput`` becomes a ``TokenEvent`` (its logprobs, and the prompt's on output 0) → a
``FinalEvent`` when it finishes; closing the generator early aborts the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pdd.core.instance import Instance
from pdd.core.pipeline import Stage
from pdd.core.request import Ending, FinalEvent, GenerateJob, RequestStats, TokenEvent
from pdd.engine.engine import Engine, StepOutput
from pdd.serving.engine_loop import EngineLoop
from pdd.serving.mailbox import StepFailed


class EngineGateway:
    """What ``OpenAIServer`` asks of a gateway, answered by one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop = EngineLoop(engine)

    async def start(self) -> None:
        await self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()

    async def instances(self) -> list[Instance]:
        return []

    async def generate(
        self, job: GenerateJob, ending: Ending | None = None
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        rid, produced, done = job.request_id, 0, False
        queue = self.loop.open(rid)
        try:
            await self.loop.call(
                self.engine.add_request,
                rid,
                list(job.prompt_token_ids),
                job.sampling,
                salt=job.cache_salt,
            )
            while True:
                item = await queue.get()
                if isinstance(item, StepFailed):
                    raise item.error
                if not isinstance(item, StepOutput):
                    raise TypeError(f"unexpected item on {rid}'s queue: {item!r}")
                if item.token_id is not None:
                    produced += 1
                    yield TokenEvent(
                        item.position,
                        (item.token_id,),
                        Stage.MAIN_DECODE,
                        () if item.logprob is None else (item.logprob,),
                        item.prompt_logprobs or (),
                    )
                if item.finished:
                    done = True
                    stats = RequestStats(
                        prompt_tokens=len(job.prompt_token_ids), completion_tokens=produced
                    )
                    yield FinalEvent(item.finish_reason, stats)
                    return
        finally:
            self.loop.close(rid)
            if not done:
                self.loop.submit(self.engine.abort, rid)  # NOTE: not awaited: runs when cancelled
