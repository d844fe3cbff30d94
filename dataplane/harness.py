"""Who a harness's turn belongs to when it sends no luftpause headers: its session
header names the run, its API key the caller and class (``LUFTPAUSE_KEY_IDENTITIES``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from luftpause import vocabulary as h

KEY_IDENTITIES_ENV = "LUFTPAUSE_KEY_IDENTITIES"
KEY_IDENTITIES_HELP = (
    f"{KEY_IDENTITIES_ENV}: JSON object from an API key (sent as x-api-key or Authorization: Bearer) to "
    '{"caller": ..., "class": "interactive"|"batch"}: the caller and class of Messages and Responses turns '
    f"without {h.CALLER} / {h.SERVICE_CLASS} headers (those headers win).")


class KeyIdentitiesError(ValueError):
    """LUFTPAUSE_KEY_IDENTITIES is malformed."""


@dataclass(frozen=True)
class KeyIdentity:
    caller: str = ""
    service_class: str = ""


def parse_key_identities(text: str) -> dict[str, KeyIdentity]:
    """The mapping from ``LUFTPAUSE_KEY_IDENTITIES``'s JSON text ("" = none)."""
    if not text.strip():
        return {}
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise KeyIdentitiesError(f"{KEY_IDENTITIES_ENV} is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise KeyIdentitiesError(f"{KEY_IDENTITIES_ENV} must be a JSON object from API key to identity")
    out: dict[str, KeyIdentity] = {}
    for key, entry in document.items():
        where = f"{KEY_IDENTITIES_ENV}[{key[:4]}...]"
        if not key or not isinstance(entry, dict) or set(entry) - {"caller", "class"}:
            raise KeyIdentitiesError(f"{where}: must be an object with 'caller' and/or 'class'")
        caller, service_class = entry.get("caller", ""), entry.get("class", "")
        if not isinstance(caller, str) or len(caller.encode()) > h.MAX_CALLER_BYTES:
            raise KeyIdentitiesError(f"{where}: 'caller' must be text of at most {h.MAX_CALLER_BYTES} bytes")
        if service_class and service_class not in h.SERVICE_CLASSES:
            raise KeyIdentitiesError(f"{where}: 'class' must be one of: {', '.join(h.SERVICE_CLASSES)}")
        out[key] = KeyIdentity(caller, service_class)
    return out


def api_key(headers: Mapping[str, str]) -> str:
    """The client's API key: Anthropic's x-api-key, else an Authorization bearer token."""
    key = headers.get("x-api-key", "").strip()
    if key:
        return key
    authorization = headers.get("Authorization", "")
    return authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
