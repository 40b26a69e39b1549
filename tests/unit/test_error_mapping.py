import grpc
import pytest

from pdd.core import errors
from pdd.server.errors import is_domain_error, status_for


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (
            errors.InvalidArgumentError("sampling.top_p", "must be in (0, 1]"),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (errors.NotFoundError("request 'r1' is unknown"), grpc.StatusCode.NOT_FOUND),
        (errors.ResourceExhaustedError("KV pool full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.UnavailableError("no main_decode registered"), grpc.StatusCode.UNAVAILABLE),
        (errors.FailedPreconditionError("KV incomplete"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.DeadlineExceededError("handoff timed out"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
        (ValueError("port: must be in 0..65535"), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_domain_errors_map_to_codes(exc, code):
    got, message = status_for(exc)
    assert got == code
    assert message
    assert is_domain_error(exc)


def test_invalid_argument_message_names_the_field():
    code, message = status_for(errors.InvalidArgumentError("max_tokens", "must be positive"))
    assert message == "max_tokens: must be positive"


def test_not_found_message_is_not_quoted():
    _, message = status_for(errors.NotFoundError("request r1 is unknown"))
    assert message == "request r1 is unknown"


def test_unexpected_errors_are_internal():
    code, message = status_for(RuntimeError("boom"))
    assert code == grpc.StatusCode.INTERNAL
    assert "RuntimeError" in message and "boom" in message
    assert not is_domain_error(RuntimeError("boom"))


def test_engine_capacity_errors():
    from pdd.engine.block_pool import PoolExhaustedError
    from pdd.engine.errors import KvCapacityError

    code, message = status_for(KvCapacityError("r1", 900, 64))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith("max_tokens:")
    assert (
        status_for(PoolExhaustedError(requested=5, free=1))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    )
