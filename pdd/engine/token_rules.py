"""The token rules every engine behind ``pdd.engine.protocol.EngineBackend`` applies the same
way (ours and vLLM's), so a request moved between engines is refused or stopped alike."""

from __future__ import annotations

from collections.abc import Sequence

from pdd.core.sampling_params import SamplingParams


def check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """``token_ids`` as a list, or ValueError naming ``field``: every engine refuses ids outside
    the vocabulary the same way."""
    ids = list(token_ids)
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field} has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


def is_stop(sp: SamplingParams, token: int, eos_token_ids: Sequence[int]) -> bool:
    """Whether ``token`` ends a request with ``sp``: one of its stop ids, or the model's eos
    unless ``ignore_eos`` (the same rule on every engine, so a handoff never changes it)."""
    return token in sp.stop_token_ids or (not sp.ignore_eos and token in eos_token_ids)
