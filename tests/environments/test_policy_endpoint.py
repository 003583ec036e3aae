"""The verifiers policy endpoint's edges: the token before the body, bodies bounded."""

from __future__ import annotations

import http.client
import time

import pytest

from grpo.environments.verifiers import MAX_BODY, PolicyEndpoint


def post(endpoint: PolicyEndpoint, length: str, token: str | None) -> tuple[int, float]:
    """Status of a POST that announces ``length`` bytes and sends none, and its seconds."""
    port = int(endpoint.url.split(":")[2].split("/")[0])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    t0 = time.monotonic()
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Length", length)
    if token is not None:
        conn.putheader("Authorization", f"Bearer {token}")
    conn.endheaders()
    status = conn.getresponse().status
    conn.close()
    return status, time.monotonic() - t0


def test_the_token_is_checked_before_a_byte_of_the_body_is_read() -> None:
    endpoint = PolicyEndpoint(timeout_s=5)
    status, seconds = post(endpoint, str(10**12), token=None)
    assert status == 401 and seconds < 5  # the announced body was never waited for
    status, _ = post(endpoint, "0", token="wrong")
    assert status == 401


@pytest.mark.parametrize("length", [str(MAX_BODY + 1), "-1", "1e3", "+5"])
def test_a_body_without_a_usable_length_is_refused_unread(length: str) -> None:
    endpoint = PolicyEndpoint(timeout_s=5)
    status, seconds = post(endpoint, length, token=endpoint.token)
    assert status == 404 and seconds < 5
