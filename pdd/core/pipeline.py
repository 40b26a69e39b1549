"""Which stages serve a request, how the relay hands over, and which stage produced a token."""

from __future__ import annotations

import enum


class Pipeline(enum.Enum):
    P_MD = "p-md"
    P_RLD_MD = "p-rld-md"
    MD = "md"


class HandoffMode(enum.Enum):
    ONE_SHOT = "one-shot"
    CATCH_UP = "catch-up"


class Stage(enum.Enum):
    """The stage that produced an output token."""

    PREFILL = "prefill"
    RELAY = "relay"
    MAIN_DECODE = "main_decode"
