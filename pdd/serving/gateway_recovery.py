"""How a gateway request survives a lost stage (``Recovery``, the fault paths ``Gateway``
inherits): everything here starts from one fact — the gateway holds every token it streamed, and
sampling draws depend only on (seed, position) — so any stage can be replaced mid-request by
replaying prompt + streamed tokens on another instance, with the output unchanged.

- relay lost before its handoff: the gateway hands MainDecode the tokens streamed itself
  (``_take_over``); so too when prefill reports it could not put the KV on the relay's fast
  link (a relay alive but never reached — say, just restarted while prefill's channel to it
  was still backing off — would otherwise wait for that KV until the client's deadline);
- MainDecode (or prefill) lost, no relay streaming: *migration* — every other stage call is
  cancelled and the request opens as MD on another live MainDecode with the tokens streamed as
  ``resume_token_ids`` (MainDecode prefills prompt + those itself and speaks from the next
  position; for a prefill loss possibly the same one);
- MainDecode (or the prefill pushing to it) lost while the relay streams: *re-home* — the relay
  decodes on alone (it learns MainDecode is gone from its own calls), the request opens as
  P-RLD-MD on another MainDecode (never the relay's own target, which the relay may still poll)
  with the tokens streamed, which rebuilds the KV; once it holds it (``Rehomed``) the gateway
  stops the relay and hands over; with no MainDecode left, or the relay finishing first, the
  relay finishes the request;
- MainDecode lost once the client has every token: the request ends at the gateway with the
  finish reason the engine would have given (``_ended``).
A stage *refusing* a request at its admission (RESOURCE_EXHAUSTED: it is full, nothing of the
request ran there) is not a loss: the request goes to another live instance of that role
(``_refused_main_decode``, ``_refused_prefill``; a refusing relay already means P-MD), or, with
none left, its client is refused with RESOURCE_EXHAUSTED — except that the only MainDecode is
asked again for a short while when prefill admitted the request (``_ask_again``: the two admit
on their own, so in a flood each can hold what the other refused). Refusals are not moves.
Moves are limited per request (``max_migrations``); beyond it, or with no MainDecode left, the
original error stands. Each move is logged (``migrated``, ``rehomed``) and counted
(``pdd_migrations_total{cause}``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import structlog

from pdd.core.errors import PddError, PeerError, UnavailableError
from pdd.core.instance import Instance, Role
from pdd.core.pipeline import HandoffMode, Pipeline, Stage
from pdd.core.stage_events import HandoffBatch
from pdd.serving.gateway_run import (
    MAIN_DECODE_LOST,
    PREFILL_LOST,
    AskAgain,
    KvDeadline,
    Loss,
    Rehomed,
    Run,
    add_reader,
    finish_here,
    stop_calls,
    wait_accepted,
)
from pdd.telemetry.metrics import HANDOFFS, MIGRATIONS
from pdd.wire.call import EventStream

log = structlog.get_logger(__name__)

# Waits before asking a full MainDecode again, when no other one is left (``_ask_again``): the
# last answer comes ~0.7 s after the first refusal.
MAIN_DECODE_FULL_WAITS_S = (0.02, 0.05, 0.1, 0.2, 0.3)


def is_refusal(error: BaseException) -> bool:
    """Whether a stage refused the request at its admission (full): nothing of it ran there."""
    return isinstance(error, PeerError) and error.code == "RESOURCE_EXHAUSTED"


class Recovery:
    """The gateway's fault paths (mixed into ``Gateway``, whose stage calls and peers they use)."""

    # NOTE: provided by Gateway.
    max_migrations: int
    eos_token_ids: tuple[int, ...] | None
    stage_timeout_s: float
    kv_deadline_s: float

    # --- a P-MD request whose KV cannot cross the WAN in time --------------------------------

    def start_kv_deadline(self, run: Run) -> None:
        """P-MD, prefill's first token out: post ``KvDeadline`` after ``kv_deadline_s``."""
        if self.kv_deadline_s <= 0 or run.plan.pipeline is not Pipeline.P_MD or run.rerouted:
            return
        queue = run.queue

        async def fire() -> None:
            await asyncio.sleep(self.kv_deadline_s)
            queue.put_nowait(KvDeadline())

        run.readers.append(asyncio.create_task(fire()))

    async def _on_kv_deadline(self, run: Run) -> None:
        """MainDecode has not spoken by the deadline (its WAN partitioned or stalled): re-route
        the request through a relay, which prefills prompt + the tokens streamed itself and
        finishes the request alone; MainDecode's and prefill's calls are cancelled (each frees
        the request's KV once the cancellation reaches it). With no relay, it waits on."""
        if (
            run.plan.pipeline is not Pipeline.P_MD
            or run.rerouted
            or run.stats.md_tokens
            or run.finish is not None
            or Stage.MAIN_DECODE not in run.streaming
            or not run.merge.emitted
            or len(run.merge.emitted) >= run.sampling.max_tokens
        ):
            return
        try:
            relays = [i for i in await self.instances() if i.ref.role is Role.RELAY]
        except PddError:
            relays = []
        if not relays:
            log.warning("kv_deadline_without_relay", main_decode=run.stats.main_decode_instance)
            return
        relay = self.rng.choice(sorted(relays, key=lambda i: i.ref.instance_id))
        for stage in (Stage.MAIN_DECODE, Stage.PREFILL):
            if (old := run.streaming.pop(stage, None)) is not None:
                old.cancel()
        run.rerouted, run.relay_done, run.md_unanswered = True, False, False
        run.plan = replace(run.plan, relay=relay, handoff_mode=HandoffMode.ONE_SHOT)
        run.stats.relay_instance = relay.ref.instance_id
        run.stats.migrations += 1
        MIGRATIONS.labels("kv_deadline").inc()
        log.warning(
            "rerouted_through_relay",
            relay=relay.ref.instance_id,
            main_decode=run.plan.main_decode.ref.instance_id,
            at=len(run.merge.emitted),
            deadline_s=self.kv_deadline_s,
        )
        add_reader(run, Stage.RELAY, self._open_relay(run))

    async def _fast_link_failed(self, run: Run) -> None:
        """Prefill could not put the KV on the relay's fast link (``TransferDone.fast_link``
        "failed"): the relay will never decode this request, but MainDecode got its delta over
        the WAN — stop the relay and hand MainDecode the tokens streamed."""
        relay = run.streaming.get(Stage.RELAY)
        if relay is None or run.relay_done or run.rehomed or run.rerouted:
            return  # NOTE: a re-routed or re-homed relay prefills itself: no fast link to wait on
        log.warning("fast_link_failed", relay=run.stats.relay_instance)
        relay.cancel()
        await self._take_over_or_move(run, "fast_link_failed_gateway_handoff")

    async def _on_failed(self, run: Run, stage: Stage, error: Exception) -> None:
        """A stage's stream broke: hand over for a lost relay, move the request to another
        MainDecode for a lost MainDecode or prefill, or fail the request. A MainDecode refusing
        the request (full) before it accepted: the request starts over on another one."""
        if stage is Stage.MAIN_DECODE and run.md_unanswered and isinstance(error, PeerError):
            # NOTE: nothing reached the client yet (tokens wait for MainDecode's Accepted).
            if is_refusal(error):
                await self._refused_main_decode(run, error)
            else:  # NOTE: no relay head start worth keeping: the request moves whole
                run.lost.add(run.plan.main_decode.ref.instance_id)
                await self._migrate(run, Loss(MAIN_DECODE_LOST, error))
            return
        if stage is Stage.RELAY and not run.relay_done:
            if run.pending is not None:  # MainDecode (or prefill) went first: now move
                await self._migrate(run, run.pending)
                return
            # NOTE: the relay is gone mid-request: drive the handoff from the tokens streamed.
            log.warning("relay_lost", error=str(error)[:200])
            await self._take_over_or_move(run, "relay_lost_gateway_handoff")
            return
        if stage is Stage.RELAY or not isinstance(error, PeerError):
            raise error
        if stage is Stage.PREFILL and (
            run.prefill_target in run.lost
            or run.prefill_target != run.plan.main_decode.ref.instance_id
        ):
            # NOTE: it was pushing to a MainDecode the request has left: nothing is lost.
            log.info("prefill_failed_after_leaving", error=str(error)[:200])
            return
        if stage is Stage.PREFILL and is_refusal(error) and not run.merge.emitted:
            await self._refused_prefill(run, error)
            return
        if run.finish is not None and stage is not Stage.MAIN_DECODE:
            raise error
        if stage is Stage.MAIN_DECODE:
            run.lost.add(run.plan.main_decode.ref.instance_id)
        loss = Loss(MAIN_DECODE_LOST if stage is Stage.MAIN_DECODE else PREFILL_LOST, error)
        if Stage.RELAY in run.streaming and not run.relay_done:
            # NOTE: the relay still streams (alone, once it finds MainDecode gone): keep it.
            await self._rehome(run, loss)
            return
        await self._migrate(run, loss)

    # --- a stage refusing the request at its admission (full) ---------------------------------

    async def _refused_main_decode(self, run: Run, error: Exception) -> None:
        """MainDecode refused the request before accepting it: every call is stopped and the
        request starts again on the same pipeline on another live MainDecode. With none left, a
        request whose prefill is still open asks the same MainDecode again after a short wait
        (``_ask_again``); past those waits ``error`` (RESOURCE_EXHAUSTED) is the client's answer.
        """
        source = run.plan.main_decode.ref.instance_id
        target = await self._next_main_decode(run, exclude=source)
        if target is None:
            if self._ask_again(run):
                return
            stop_calls(run)
            raise error
        run.lost.add(source)  # NOTE: never asked again for this request
        stop_calls(run)
        log.info(
            "refused_rerouted",
            role="main_decode",
            from_instance=source,
            to_instance=target.ref.instance_id,
        )
        run.plan = replace(run.plan, main_decode=target)
        run.stats.main_decode_instance = target.ref.instance_id
        await self._start(run)

    def _ask_again(self, run: Run) -> bool:
        """Whether the refusing MainDecode, the only one, will be asked again: only while the
        request's prefill call is open, up to ``MAIN_DECODE_FULL_WAITS_S``. Prefill and
        MainDecode admit each request on their own, so under a flood each may hold the requests
        the other refused; those the other refuses are refused to their clients at once, which
        frees their places here within ms. Refusing every request the two did not both admit
        would refuse everyone. Prefill's call stays open (waiting for its bind) meanwhile."""
        waits = MAIN_DECODE_FULL_WAITS_S
        if Stage.PREFILL not in run.streaming or run.md_full_waits >= len(waits):
            return False
        delay_s = waits[run.md_full_waits]
        run.md_full_waits += 1
        run.streaming.pop(Stage.MAIN_DECODE, None)  # NOTE: its end is no loss
        queue, attempt = run.queue, run.md_full_waits

        async def later() -> None:
            await asyncio.sleep(delay_s)
            queue.put_nowait(AskAgain(attempt))

        run.readers.append(asyncio.create_task(later()))
        log.info("refused_asked_again", main_decode=run.stats.main_decode_instance, in_s=delay_s)
        return True

    def on_ask_again(self, run: Run, item: AskAgain) -> None:
        """The wait after a MainDecode refusal is over: open its call again, unless the request
        moved on meanwhile (prefill refused or lost: the request is refused or moved)."""
        if (
            item.attempt != run.md_full_waits
            or not run.md_unanswered
            or Stage.MAIN_DECODE in run.streaming
            or Stage.PREFILL not in run.streaming
        ):
            return
        plan = run.plan
        add_reader(run, Stage.MAIN_DECODE, self._open_decode(run, plan.main_decode, plan.pipeline))

    async def _refused_prefill(self, run: Run, error: Exception) -> None:
        """Prefill refused the request before computing any of it: another live prefill takes
        it (MainDecode and the relay, which accepted, wait on for its KV); with none left,
        ``error`` (RESOURCE_EXHAUSTED) is the client's answer."""
        source = run.plan.prefill.ref.instance_id
        run.lost.add(source)
        target = await self._next_instance(run, Role.PREFILL)
        if target is None:
            raise error
        log.info(
            "refused_rerouted",
            role="prefill",
            from_instance=source,
            to_instance=target.ref.instance_id,
        )
        run.plan = replace(run.plan, prefill=target)
        run.stats.prefill_instance = target.ref.instance_id
        add_reader(run, Stage.PREFILL, self._open_prefill(run))

    async def _rehome(self, run: Run, loss: Loss) -> None:
        """The relay streams on while its MainDecode (or the prefill pushing to it) is lost:
        rebuild the request on another MainDecode beside the relay (pipeline P-RLD-MD from the
        tokens streamed: it prefills those itself) and take the request from the relay once that
        one holds the KV (``Rehomed``); with none left, the relay finishes the request alone."""
        at = tuple(run.merge.emitted)
        if not at or (loss.cause == PREFILL_LOST and run.stats.rld_tokens == 0):
            # NOTE: no head start to keep, or the relay may never get its KV: move it all.
            await self._migrate(run, loss)
            return
        if (old := run.streaming.pop(Stage.MAIN_DECODE, None)) is not None:
            old.cancel()  # NOTE: it waits for a push that will not come
        run.rehomed = run.md_unanswered = False  # NOTE: the relay's tokens flow on meanwhile
        # NOTE: nothing here waits on the new MainDecode (the relay's tokens keep flowing): its
        # Accepted starts the wait for its KV (``on_rehome_accepted``); a refusal fails its
        # stream, which comes back here for the next one.
        target = None
        if run.stats.migrations < self.max_migrations and len(at) < run.sampling.max_tokens:
            target = await self._next_main_decode(run, exclude=run.relay_target)
        if target is None:
            log.warning("relay_finishes_request", at=len(at), cause=loss.cause)
            return
        run.stats.migrations += 1
        MIGRATIONS.labels(loss.cause).inc()
        log.warning(
            "rehomed",
            from_instance=run.plan.main_decode.ref.instance_id,
            to_instance=target.ref.instance_id,
            at=len(at),
            cause=loss.cause,
            error=str(loss.error)[:200],
        )
        stream = self._open_decode(run, target, Pipeline.P_RLD_MD, at)
        run.plan = replace(run.plan, main_decode=target)
        run.stats.main_decode_instance = target.ref.instance_id
        run.rehomed = True
        add_reader(run, Stage.MAIN_DECODE, stream)

    def on_rehome_accepted(self, run: Run, stream: EventStream) -> None:
        """The re-homed MainDecode accepted: wait (beside the stream) for it to hold the KV."""
        target = run.plan.main_decode
        run.readers.append(asyncio.create_task(self._await_kv(run, target, stream)))

    async def _await_kv(self, run: Run, target: Instance, stream: EventStream) -> None:
        """Post ``Rehomed`` once the re-homed MainDecode holds the KV (its loss fails its own
        stream, which decides what happens next)."""
        client, queue = self.peers.main_decode(target.ref.address), run.queue
        deadline = time.monotonic() + self.stage_timeout_s
        while (left_s := deadline - time.monotonic()) > 0:
            try:
                readiness = await client.wait_kv_ready(
                    run.job.request_id, int(min(left_s, 30.0) * 1000)
                )
            except PeerError:
                return
            if readiness.ready:
                queue.put_nowait(Rehomed(stream))
                return

    async def _on_rehomed(self, run: Run, stream: object) -> None:
        """The re-homed MainDecode holds the KV: stop the relay, hand the tokens streamed over."""
        relay = run.streaming.get(Stage.RELAY)
        if not (run.rehomed and run.current(Stage.MAIN_DECODE, stream)) or relay is None:
            return
        if run.relay_done:
            return
        relay.cancel()
        await self._take_over_or_move(run, "rehomed_gateway_handoff")

    async def _relay_ended(self, run: Run) -> None:
        """The relay's stream is over: a loss waiting on it moves the request now; a re-homed
        MainDecode still waiting for the handoff is stopped if the relay finished the request;
        one the relay took for lost and finished without, still waiting, gets the tokens as a
        finished request (its DRC keeps them for the session's next turn)."""
        if run.pending and run.finish is None:
            await self._migrate(run, run.pending)
        elif run.rehomed and run.finish is not None:
            log.warning("relay_finished_rehomed_request", at=len(run.merge.emitted))
            if (md := run.streaming.pop(Stage.MAIN_DECODE, None)) is not None:
                md.cancel()
            run.rehomed = False
        elif run.relay_alone and run.finish is not None and Stage.MAIN_DECODE in run.streaming:
            # NOTE: the client has every token: a MainDecode gone meanwhile just ends its call
            try:
                await self._take_over(run, "relay_finished_alone_gateway_handoff", finished=True)
            except (PeerError, UnavailableError) as exc:
                log.warning("finished_handoff_failed", error=str(exc)[:200])
                if (md := run.streaming.pop(Stage.MAIN_DECODE, None)) is not None:
                    md.cancel()

    async def _migrate(self, run: Run, loss: Loss) -> None:
        """Move the request to another live MainDecode from the tokens streamed so far (every
        other stage call cancelled; MainDecode prefills what it lacks itself), or finish it here
        if the client has every token already; the original error if the limit is reached, no
        MainDecode is left or nothing is left to decode."""
        stop_calls(run)
        if (reason := self._ended(run)) is not None:
            finish_here(run, reason, loss)
            return
        run.merge.pending.clear()  # NOTE: held tokens of the old path: the new one recomputes them
        at = len(run.merge.emitted)
        while run.stats.migrations < self.max_migrations and at < run.sampling.max_tokens:
            target = await self._next_main_decode(run)
            if target is None:
                break
            run.stats.migrations += 1
            MIGRATIONS.labels(loss.cause).inc()
            source, run.plan = run.plan.main_decode, replace(run.plan, main_decode=target)
            log.warning(
                "migrated",
                from_instance=source.ref.instance_id,
                to_instance=target.ref.instance_id,
                at=at,
                cause=loss.cause,
                error=str(loss.error)[:200],
            )
            try:
                await self._resume(run, target)
                return
            except (PeerError, UnavailableError) as exc:
                log.warning("migration_refused", instance=target.ref.instance_id, error=str(exc))
                run.lost.add(target.ref.instance_id)
                loss = Loss(MAIN_DECODE_LOST, loss.error)
        raise loss.error

    def _ended(self, run: Run) -> str | None:
        """Why the request ended, if the client has every token and the gateway can tell as the
        engine would (a stop token ends it, even the last one; else max_tokens: "length"). None
        if it may go on or only MainDecode can say (a grammar completed, an eos id unknown
        here): then it migrates with what was streamed and the new MainDecode says."""
        if run.finish is not None:  # NOTE: a stage said so already (the relay finished it)
            return run.finish
        out, sp = run.merge.emitted, run.sampling
        if not out:
            return None
        eos = () if sp.ignore_eos else self.eos_token_ids
        if out[-1] in sp.stop_token_ids or (eos is not None and out[-1] in eos):
            return "stop"
        if len(out) >= sp.max_tokens and eos is not None:
            return "length"
        return None

    async def _next_main_decode(self, run: Run, exclude: str = "") -> Instance | None:
        """A live MainDecode not lost for this request, nor ``exclude`` (the seeded rng picks
        among them)."""
        return await self._next_instance(run, Role.MAIN_DECODE, exclude)

    async def _next_instance(self, run: Run, role: Role, exclude: str = "") -> Instance | None:
        """A live instance of ``role`` not lost (or refusing) for this request, nor ``exclude``
        (the seeded rng picks among them)."""
        try:
            instances = await self.instances()
        except PddError as exc:
            log.warning("migration_without_instances", error=str(exc)[:200])
            return None
        candidates = sorted(
            (
                i
                for i in instances
                if i.ref.role is role
                and i.ref.instance_id not in run.lost
                and i.ref.instance_id != exclude
            ),
            key=lambda i: i.ref.instance_id,
        )
        return self.rng.choice(candidates) if candidates else None

    async def _resume(self, run: Run, target: Instance) -> None:
        """Open the request on ``target`` as MD from the tokens streamed; read it once accepted."""
        stream = self._open_decode(run, target, Pipeline.MD, tuple(run.merge.emitted))
        await wait_accepted(stream, Stage.MAIN_DECODE)
        # NOTE: no relay and no prefill any more: nothing to take over, nothing pending.
        run.relay_done, run.pending, run.rehomed, run.md_unanswered = True, None, False, False
        run.stats.main_decode_instance = target.ref.instance_id
        self._read(run, [(Stage.MAIN_DECODE, stream)])

    async def _take_over_or_move(self, run: Run, event: str) -> None:
        """``_take_over``; a MainDecode lost meanwhile moves the request (``_migrate``)."""
        try:
            await self._take_over(run, event)
        except (PeerError, UnavailableError) as exc:
            run.lost.add(run.plan.main_decode.ref.instance_id)
            await self._migrate(run, Loss(MAIN_DECODE_LOST, exc))

    async def _take_over(self, run: Run, event: str, *, finished: bool = False) -> None:
        """Hand the request to MainDecode ourselves: token IDs are all it needs besides its KV
        (``finished``: the request ended; MainDecode keeps them in its DRC, emits nothing)."""
        plan, tokens = run.plan, tuple(run.merge.emitted)
        log.warning(event, at=len(tokens), main_decode=plan.main_decode.ref.instance_id)
        HANDOFFS.labels(
            plan.handoff_mode.value if plan.handoff_mode else "one-shot", "gateway"
        ).inc()
        call = self.peers.main_decode(plan.main_decode.ref.address).token_handoff()
        run.calls.append(call)
        batch = HandoffBatch(
            run.job.request_id,
            0,
            tokens,
            final=True,
            request_finished=finished,
            mode=plan.handoff_mode,
        )
        await call.send(batch)
        await call.done(wait=True)
        run.stats.handoff_at_token = len(tokens)
        run.relay_done, run.rehomed = True, False
