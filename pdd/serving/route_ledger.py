"""What the gateway knows between two heartbeats: ``RouteLedger``.

Instances report their load, and prefill its WAN links' state, once per heartbeat (a third of
the lease: seconds); a burst routed between two would all see the same old picture. The gateway
knows its own part of what changed at once, and the router (pure policy) takes it as input:

- **relay holds**: requests it sent through each relay and has not seen leave — a lower bound of
  the relay's load (the guarded relay's ``relay_max_requests``);
- **link holds**: KV bytes of the deltas it sent onto each WAN link (by remote cluster) and has
  not seen cross (prefill's ``TransferDone``, or the request's end) — the bytes a new delta
  queues behind, when more than the link's aged report (``LinkState.transfer_s``);
- **first-token latency**: the median of its recent requests' TTFT (the first token, from
  prefill or from a MainDecode prefilling locally: no WAN transfer is in it), which scales the
  link-aware router's budget to the deployment (``pdd.routing.policy.ttft_budget``).
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import replace

from pdd.core.instance import Instance, Role
from pdd.core.pipeline import Pipeline
from pdd.routing.policy import Route


class RouteLedger:
    def __init__(self, ttft_window: int = 64, ttft_min_samples: int = 8) -> None:
        """``ttft_window``: recent first-token latencies the reference is the median of;
        ``ttft_min_samples``: how many it needs before there is a reference at all."""
        if ttft_window < 1:
            raise ValueError(f"ttft_window: must be >= 1, got {ttft_window}")
        if not 1 <= ttft_min_samples <= ttft_window:
            raise ValueError(
                f"ttft_min_samples: must be in [1, ttft_window], got {ttft_min_samples}"
            )
        # request id → relay id
        self._relays: dict[str, str] = {}
        # request id → (remote cluster, KV bytes)
        self._links: dict[str, tuple[str, int]] = {}
        self._ttfts: deque[float] = deque(maxlen=ttft_window)
        self._ttft_min = ttft_min_samples

    def hold(self, request_id: str, plan: Route, prompt_len: int, kv_bytes_per_token: int) -> None:
        """Enter what a routed request will hold: its relay, its delta on its MainDecode's link."""
        if plan.relay is not None:
            self.hold_relay(request_id, plan.relay.ref.instance_id)
        if plan.pipeline in (Pipeline.P_MD, Pipeline.P_RLD_MD):
            delta = prompt_len - plan.predicted_md_cached_tokens
            self.hold_link(request_id, plan.main_decode.ref.cluster, delta * kv_bytes_per_token)

    # --- relays -------------------------------------------------------------------------------

    def hold_relay(self, request_id: str, relay_id: str) -> None:
        self._relays[request_id] = relay_id

    def release_relay(self, request_id: str) -> None:
        """The request left its relay (handed off, finished, refused) or ended."""
        self._relays.pop(request_id, None)

    def with_relay_holds(self, instances: Sequence[Instance]) -> list[Instance]:
        """Each relay's load as at least the requests held on it here."""
        held = Counter(self._relays.values())
        out = []
        for inst in instances:
            mine = held.get(inst.ref.instance_id, 0)
            if inst.ref.role is Role.RELAY and mine > inst.load.running_requests:
                inst = replace(inst, load=replace(inst.load, running_requests=mine))
            out.append(inst)
        return out

    # --- WAN links ----------------------------------------------------------------------------

    def hold_link(self, request_id: str, cluster: str, kv_bytes: int) -> None:
        if kv_bytes > 0:
            self._links[request_id] = (cluster, kv_bytes)

    def release_link(self, request_id: str) -> None:
        """The request's delta crossed (or never will: the request ended)."""
        self._links.pop(request_id, None)

    def pending_bytes(self) -> dict[str, int]:
        """KV bytes sent onto each link (by remote cluster) and not yet seen cross."""
        out: dict[str, int] = {}
        for cluster, n in self._links.values():
            out[cluster] = out.get(cluster, 0) + n
        return out

    # --- first-token latency ------------------------------------------------------------------

    def observe_ttft(self, seconds: float) -> None:
        if seconds > 0:
            self._ttfts.append(seconds)

    def reference_ttft_s(self) -> float | None:
        """The median of the recent first-token latencies; None until enough were seen."""
        if len(self._ttfts) < self._ttft_min:
            return None
        return statistics.median(self._ttfts)

    def release(self, request_id: str) -> None:
        """The request ended: nothing of it is held anywhere any more."""
        self.release_relay(request_id)
        self.release_link(request_id)
