"""Identity headers no well-behaved client sends: the proxy answers 400 with a JSON
message, never a 5xx, and takes UTF-8 callers as they are."""

from __future__ import annotations

import httpx
import pytest

from luftpause import vocabulary as h
from luftpause.vocabulary import MAX_ID_BYTES

BODY = {"model": "fake-llama-1b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def post(proxy_stack, extra: dict[str, str | bytes]) -> httpx.Response:
    url = f"http://127.0.0.1:{proxy_stack.ports.dataplane}/v1/chat/completions"
    return httpx.post(url, json=BODY, headers=extra, timeout=30)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({h.RUN_ID: "r" * (MAX_ID_BYTES + 1)}, h.RUN_ID),
        ({h.RUN_ID: b"run-\xff\xfe"}, h.RUN_ID),
        ({h.CALLER: b"caf\xe9"}, h.CALLER),  # Latin-1, not UTF-8
        # A harness's session header names the run as x-luftpause-run-id does: held to the same rules.
        ({"x-session-id": "s" * (MAX_ID_BYTES + 1)}, "x-session-id"),
        ({"x-session-affinity": b"ses_\xff\xfe"}, "x-session-affinity"),
    ],
)
def test_malformed_identity_headers_are_400(proxy_stack, extra: dict[str, str | bytes], named: str) -> None:
    response = post(proxy_stack, extra)
    assert response.status_code == 400 and named in response.json()["error"]["message"], response.text


def test_a_utf8_caller_is_served(proxy_stack) -> None:
    response = post(proxy_stack, {h.CALLER: "café".encode(), h.RUN_ID: "run-utf8"})
    assert response.status_code == 200, response.text
