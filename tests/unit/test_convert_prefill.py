"""``pdd.wire.prefill``: the prefill job (MainDecode's hit known, zero, or bound later) and the
bind, both ways."""

from __future__ import annotations

import pytest

from pdd.core.errors import InvalidArgumentError
from pdd.core.instance import InstanceRef, Role
from pdd.core.pipeline import Pipeline
from pdd.core.sampling_params import SamplingParams
from pdd.core.stage_events import PrefillJob
from pdd.gen.prefill.v1 import prefill_service_pb2 as pb
from pdd.wire import prefill as conv

MD = InstanceRef("md-0", "md:1", Role.MAIN_DECODE, "remote")
RELAY = InstanceRef("relay-0", "relay:1", Role.RELAY)


@pytest.mark.parametrize("cached", [None, 0, 5], ids=["later", "none-held", "five-held"])
@pytest.mark.parametrize("pipeline", [Pipeline.P_MD, Pipeline.P_RLD_MD])
def test_a_prefill_job_round_trips(cached, pipeline):
    relay = RELAY if pipeline is Pipeline.P_RLD_MD else None
    job = PrefillJob(
        "r",
        (1, 2, 3, 4, 5, 6),
        SamplingParams(max_tokens=4),
        "s",
        pipeline,
        MD,
        cached,
        relay,
        burst_following=3,
    )
    msg = conv.job_to_pb(job)
    assert msg.main_decode_cached_tokens_later is (cached is None)
    back = conv.job_from_pb(pb.PrefillRequest.FromString(msg.SerializeToString()), vocab=64)
    assert back == job


def test_a_bind_round_trips_and_needs_a_request_id():
    msg = conv.bind_to_pb("r-1", 7)
    assert conv.bind_from_pb(pb.BindMainDecodeRequest.FromString(msg.SerializeToString())) == (
        "r-1",
        7,
    )
    with pytest.raises(InvalidArgumentError, match="request_id"):
        conv.bind_from_pb(pb.BindMainDecodeRequest(main_decode_cached_tokens=3))
