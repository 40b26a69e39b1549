"""One request's output as text: token events → detokenized, stop-string-cut deltas.

Runs ``Gateway.generate`` (the one request life) and turns its events into
``Delta``s and one ``End``. A stop string ends the request early: the
generator is closed, which cancels every stage call (and frees the KV).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from pdd.http.stop_strings import StopStrings
from pdd.serving.detokenizer import Detokenizer
from pdd.serving.gateway import Ending, Gateway, GenerateJob, TokenEvent


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class End:
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


async def text_events(gateway: Gateway, job: GenerateJob, decode: Callable[[Sequence[int]], str] | None,
                      stop: Sequence[str] = ()) -> AsyncIterator[Delta | End]:
    detok, stops = Detokenizer(decode), StopStrings(stop)
    produced = 0
    ending = Ending()
    async with contextlib.aclosing(gateway.generate(job, ending)) as events:
        async for ev in events:
            if isinstance(ev, TokenEvent):
                produced += len(ev.token_ids)
                text = stops.feed(detok.add(ev.token_ids))
                yield Delta(text, ev.token_ids)
                if stops.hit:
                    ending.reason = "stop"  # NOTE: before the close below, so metrics say stop, not cancelled
                    yield End("stop", len(job.prompt_token_ids), produced)
                    return
                continue
            if tail := stops.flush():
                yield Delta(tail, ())
            yield End(ev.finish_reason, ev.stats.prompt_tokens, ev.stats.completion_tokens)
