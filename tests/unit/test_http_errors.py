import grpc
import pytest

from pdd.core import errors
from pdd.http.errors import ApiError, http_error_for, is_expected


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (errors.InvalidArgumentError("top_p", "must be in (0, 1]"), 400, "invalid_request_error"),
        (errors.NotFoundError("request r1 is unknown"), 404, "not_found_error"),
        (errors.ResourceExhaustedError("KV pool full"), 429, "rate_limit_error"),
        (errors.UnavailableError("no main_decode registered"), 503, "service_unavailable_error"),
        (errors.FailedPreconditionError("token stream has a gap"), 500, "server_error"),
        (errors.DeadlineExceededError("handoff timed out"), 504, "timeout_error"),
        (TimeoutError(), 504, "timeout_error"),
        (ValueError("bad"), 400, "invalid_request_error"),
    ],
)
def test_domain_errors_map_to_http_codes(exc, status, kind):
    got, body = http_error_for(exc)
    assert got == status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == kind and body["error"]["message"]
    assert is_expected(exc)


def test_invalid_argument_names_its_param():
    _, body = http_error_for(errors.InvalidArgumentError("max_tokens", "must be positive"))
    assert body["error"]["param"] == "max_tokens"
    assert body["error"]["message"] == "max_tokens: must be positive"


def test_api_errors_carry_their_own_terms():
    status, body = http_error_for(
        ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
    )
    assert status == 401
    assert body == {
        "error": {
            "message": "Incorrect API key provided.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_a_stage_services_status_maps_by_code(code, status):
    exc = grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="relay-0 is gone"
    )
    got, body = http_error_for(exc)
    assert got == status and "relay-0 is gone" in body["error"]["message"]


def test_unexpected_errors_are_500_and_not_expected():
    status, body = http_error_for(RuntimeError("boom"))
    assert status == 500 and "RuntimeError" in body["error"]["message"]
    assert not is_expected(RuntimeError("boom"))
