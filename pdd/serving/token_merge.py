"""The gateway's merge of the stages' token deltas into one gap-free stream, by output position.

Prefill sends position 0, the relay its tokens, MainDecode its own from where the relay handed
over; catch-up rounds and the relay's playout lead make them overlap. A position is taken from
whichever stage sent it first (greedy and seeded sampling make them agree) and held until every
earlier one is out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdd.core.pipeline import Stage
from pdd.core.request import TokenEvent
from pdd.core.sampling_params import Logprob


@dataclass
class TokenMerge:
    """Orders token deltas from several stages by output position."""

    next_pos: int = 0
    pending: dict[int, tuple[int, Stage, Logprob | None]] = field(default_factory=dict)
    # Every token streamed so far, in order: the whole state a handoff needs besides KV.
    emitted: list[int] = field(default_factory=list)

    def add(
        self, start: int, tokens: Sequence[int], stage: Stage, logprobs: Sequence[Logprob] = ()
    ) -> list[TokenEvent]:
        """``logprobs``: one per token, or none (the request did not ask for them)."""
        for i, tok in enumerate(tokens):
            pos = start + i
            if pos >= self.next_pos and pos not in self.pending:
                self.pending[pos] = (tok, stage, logprobs[i] if logprobs else None)
        out: list[TokenEvent] = []
        while self.next_pos in self.pending:
            tok, stage, lp = self.pending.pop(self.next_pos)
            self.emitted.append(tok)
            lps = () if lp is None else (lp,)
            if out and out[-1].stage == stage:
                last = out[-1]
                out[-1] = TokenEvent(
                    last.start_position, (*last.token_ids, tok), stage, (*last.logprobs, *lps)
                )
            else:
                out.append(TokenEvent(self.next_pos, (tok,), stage, lps))
            self.next_pos += 1
        return out
