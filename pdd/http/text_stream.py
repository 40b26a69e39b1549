"""One request's output as text: token events → detokenized, stop-string-cut deltas.

Runs ``Gateway.generate`` (the one request life) and turns its events into
``Delta``s and one ``End``. A stop string ends the request early: the
generator is closed, which cancels every stage call (and frees the KV).
``choice_events`` runs several (OpenAI's ``n``) side by side, events tagged
with the choice's index, within the request's ``timeout`` when it has one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from pdd.core.errors import DeadlineExceededError
from pdd.core.pipeline import Pipeline
from pdd.core.request import Ending, GenerateJob, RequestStats, TokenEvent
from pdd.core.sampling_params import Logprob
from pdd.http.stop_strings import StopStrings
from pdd.serving.detokenizer import Detokenizer
from pdd.serving.gateway import Gateway


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob, ...] = ()  # one per token when the request asked for them
    # On the delta of output position 0: the prompt's logprobs (tokens 1..n-1) when asked for
    prompt_logprobs: tuple[Logprob, ...] | None = None


@dataclass(frozen=True)
class End:
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens the stage that computed the prompt found in its prefix cache (None: unknown,
    # e.g. a stop string ended the request before its stats came)
    cached_tokens: int | None = None


def cached_tokens(stats: RequestStats) -> int | None:
    """The prompt tokens served from a prefix cache: prefill's hit when prefill computed the prompt,
    MainDecode's on pipeline MD (None: the request was never routed)."""
    if stats.pipeline is None:
        return None
    return stats.md_cached_tokens if stats.pipeline is Pipeline.MD else stats.prefill_cached_tokens


async def text_events(
    gateway: Gateway,
    job: GenerateJob,
    decode: Callable[[Sequence[int]], str] | None,
    stop: Sequence[str] = (),
    deadline_s: float | None = None,
) -> AsyncIterator[Delta | End]:
    detok, stops = Detokenizer(decode), StopStrings(stop)
    produced = 0
    ending = Ending()
    generate = gateway.generate(job, ending, deadline_s=deadline_s)
    async with contextlib.aclosing(generate) as events:
        async for ev in events:
            if isinstance(ev, TokenEvent):
                produced += len(ev.token_ids)
                text = stops.feed(detok.add(ev.token_ids))
                prompt = ev.prompt_logprobs if ev.start_position == 0 else None
                yield Delta(text, ev.token_ids, ev.logprobs, prompt)
                if stops.hit:
                    ending.reason = (
                        "stop"  # NOTE: before the close below, so metrics say stop, not cancelled
                    )
                    yield End("stop", len(job.prompt_token_ids), produced)
                    return
                continue
            if tail := stops.flush():
                yield Delta(tail, ())
            stats = ev.stats
            yield End(
                ev.finish_reason, stats.prompt_tokens, stats.completion_tokens, cached_tokens(stats)
            )


async def choice_events(
    gateway: Gateway,
    jobs: Sequence[GenerateJob],
    decode: Callable[[Sequence[int]], str] | None,
    stop: Sequence[str] = (),
    timeout_s: float | None = None,
) -> AsyncIterator[tuple[int, Delta | End]]:
    """``(index, event)`` of every job's ``text_events``, as they come; each job ends with its own
    ``End``. The first failure of any job is raised here and, like closing this generator early,
    cancels every job still running (their stage calls and KV with them). ``timeout_s``: the
    request's deadline from now, given to every stage call (as a gRPC client's deadline is);
    past it the request is cancelled and ``DeadlineExceededError`` raised (HTTP 504)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    events = _choices(gateway, jobs, decode, stop, timeout_s)
    async with contextlib.aclosing(events):
        if deadline is None:  # NOTE: once per streamed chunk: no timer to arm and cancel
            async for item in events:
                yield item
            return
        while True:
            # NOTE: a timeout of its own per wait, so that a TimeoutError raised below is not ours.
            within = asyncio.timeout_at(deadline)
            try:
                async with within:
                    item = await anext(events)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if not within.expired():
                    raise
                raise DeadlineExceededError(
                    f"timeout: the request's timeout of {timeout_s:g} s passed"
                ) from None
            yield item


async def _choices(
    gateway: Gateway,
    jobs: Sequence[GenerateJob],
    decode: Callable[[Sequence[int]], str] | None,
    stop: Sequence[str],
    deadline_s: float | None,
) -> AsyncIterator[tuple[int, Delta | End]]:
    if len(jobs) == 1:
        texts = text_events(gateway, jobs[0], decode, stop, deadline_s)
        async with contextlib.aclosing(texts) as events:
            async for ev in events:
                yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Delta | End | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, job: GenerateJob) -> None:
        try:
            texts = text_events(gateway, job, decode, stop, deadline_s)
            async with contextlib.aclosing(texts) as events:
                async for ev in events:
                    queue.put_nowait((index, ev, None))
        except Exception as exc:  # noqa: BLE001 — handed to the consumer, which raises it
            queue.put_nowait((index, None, exc))
            return
        queue.put_nowait((index, None, None))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        running = len(tasks)
        while running:
            index, ev, exc = await queue.get()
            if exc is not None:
                raise exc
            if ev is None:
                running -= 1
                continue
            yield index, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
