"""Tenant keys: API keys that authenticate a client *as* a caller (docs/security.md,
"Tenants").

``LUFTPAUSE_KEY_IDENTITIES`` (a JSON object) and/or ``LUFTPAUSE_KEYS_FILE`` (a file holding
the same JSON) map each key to ``{"caller": ..., "class": "interactive"|"batch"}``. A key
is written as it is sent, or as ``sha256:<64 hex digits>`` of it, so a file can hold the
keys' hashes instead of the keys. A client presents its key as ``x-api-key`` (Anthropic
clients) or ``Authorization: Bearer <key>``.

A request that presents a tenant key is that caller, whatever its headers say: the
dataplane and the runtime refuse an ``x-luftpause-caller`` (or an ``x-luftpause-class``
where the key names a class) that differs (403), and show and let it touch only that
caller's runs. ``LUFTPAUSE_TOKEN`` is then the operator's key: the services present it to
each other, and a client presenting it sees every caller (as without keys). Tenant keys
need the token (the runtime's sub-agent turns reach the dataplane with it). The rules a
turn follows (its identity, the runs it may join or end) are here too, for the
dataplane and the Envoy endpoint picker alike. Stdlib only: the runtime imports this at
start.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from luftpause import vocabulary as h
from luftpause.errors import LuftpauseError

KEY_IDENTITIES_ENV = "LUFTPAUSE_KEY_IDENTITIES"
KEYS_FILE_ENV = "LUFTPAUSE_KEYS_FILE"
HASHED = "sha256:"
KEY_IDENTITIES_HELP = (
    f"{KEY_IDENTITIES_ENV} (JSON) and/or {KEYS_FILE_ENV} (a file of the same JSON): tenant keys, from an API key "
    f"(sent as x-api-key or Authorization: Bearer; or written as {HASHED}<hex of its SHA-256>) to "
    '{"caller": ..., "class": "interactive"|"batch"}: a client presenting one is that caller (a header naming '
    "another is refused) and sees only its own runs; LUFTPAUSE_TOKEN is then the operator's key.")


class KeyIdentitiesError(LuftpauseError, ValueError):
    """The tenant keys are malformed (or set without LUFTPAUSE_TOKEN)."""


@dataclass(frozen=True)
class KeyIdentity:
    caller: str = ""
    service_class: str = ""


def parse_key_identities(text: str, source: str = KEY_IDENTITIES_ENV) -> dict[str, KeyIdentity]:
    """The mapping from JSON text ("" = none); keys as written (plain, or ``sha256:``)."""
    if not text.strip():
        return {}
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise KeyIdentitiesError(f"{source} is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise KeyIdentitiesError(f"{source} must be a JSON object from API key to identity")
    out: dict[str, KeyIdentity] = {}
    for key, entry in document.items():
        where = f"{source}[{key[:4]}...]"
        if not key or not isinstance(entry, dict) or set(entry) - {"caller", "class"}:
            raise KeyIdentitiesError(f"{where}: must be an object with 'caller' and optionally 'class'")
        if key.startswith(HASHED) and (len(key) != len(HASHED) + 64
                                       or any(c not in "0123456789abcdef" for c in key[len(HASHED):])):
            raise KeyIdentitiesError(f"{where}: a hashed key is {HASHED} and 64 lowercase hex digits")
        caller, service_class = entry.get("caller", ""), entry.get("class", "")
        if not isinstance(caller, str) or not caller.strip() or len(caller.encode()) > h.MAX_CALLER_BYTES:
            raise KeyIdentitiesError(f"{where}: 'caller' (the key's tenant) must be text of 1 to "
                                     f"{h.MAX_CALLER_BYTES} bytes")
        if service_class and service_class not in h.SERVICE_CLASSES:
            raise KeyIdentitiesError(f"{where}: 'class' must be one of: {', '.join(h.SERVICE_CLASSES)}")
        out[key] = KeyIdentity(caller, service_class)
    return out


def presented_keys(headers: Mapping[str, str]) -> list[str]:
    """The keys a request presents, in the order they count: Anthropic's x-api-key, then
    an Authorization bearer token."""
    keys = []
    key = headers.get("x-api-key", "").strip()
    if key:
        keys.append(key)
    authorization = headers.get("Authorization", "") or headers.get("authorization", "")
    if authorization[:7].lower() == "bearer " and authorization[7:].strip():
        keys.append(authorization[7:].strip())
    return keys


class Keys:
    """The tenant keys, looked up by what a request presents."""

    def __init__(self, identities: Mapping[str, KeyIdentity] | None = None) -> None:
        identities = dict(identities or {})
        self._plain = {k: v for k, v in identities.items() if not k.startswith(HASHED)}
        self._hashed = {k[len(HASHED):]: v for k, v in identities.items() if k.startswith(HASHED)}

    def __bool__(self) -> bool:
        return bool(self._plain or self._hashed)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Keys) and (self._plain, self._hashed) == (other._plain, other._hashed)

    __hash__ = None  # mutable-looking: compared by value, not hashed

    def identify(self, key: str) -> KeyIdentity | None:
        """The identity ``key`` names, or None."""
        if not key:
            return None
        for known, identity in self._plain.items():  # each compared in constant time
            if hmac.compare_digest(known.encode(), key.encode()):
                return identity
        if self._hashed:
            return self._hashed.get(hashlib.sha256(key.encode()).hexdigest())
        return None

    def of_request(self, headers: Mapping[str, str]) -> KeyIdentity | None:
        """The tenant a request's headers authenticate: its x-api-key, else its bearer token."""
        if not self:
            return None
        for key in presented_keys(headers):
            identity = self.identify(key)
            if identity is not None:
                return identity
        return None

    @classmethod
    def from_env(cls, environ: Mapping[str, str], token: str | None) -> Keys:
        """``LUFTPAUSE_KEY_IDENTITIES`` and ``LUFTPAUSE_KEYS_FILE`` together; KeyIdentitiesError
        when malformed, or set without the operator's token."""
        identities = parse_key_identities(environ.get(KEY_IDENTITIES_ENV, ""))
        path = environ.get(KEYS_FILE_ENV, "")
        if path:
            try:
                text = Path(path).read_text()
            except OSError as exc:
                raise KeyIdentitiesError(f"{KEYS_FILE_ENV}: cannot read {path}: {exc.strerror or exc}") from None
            identities.update(parse_key_identities(text, f"{KEYS_FILE_ENV} ({path})"))
        if identities and not token:
            raise KeyIdentitiesError(
                f"tenant keys ({KEY_IDENTITIES_ENV} / {KEYS_FILE_ENV}) need LUFTPAUSE_TOKEN: it is the operator's "
                "key, which the services present to each other")
        return cls(identities)


@dataclass(frozen=True)
class Refusal:
    """A header that contradicts the tenant key presented with it (403)."""

    message: str


def contradiction(identity: KeyIdentity, headers: Mapping[str, str]) -> Refusal | None:
    """Why the request's identity headers cannot go with its tenant key, or None."""
    caller = headers.get(h.CALLER)
    if caller is not None and caller.strip() != identity.caller:
        return Refusal(f"this API key is caller {identity.caller!r}: {h.CALLER} cannot name another")
    service_class = headers.get(h.SERVICE_CLASS)
    if identity.service_class and service_class is not None and service_class.strip() != identity.service_class:
        return Refusal(f"this API key is class {identity.service_class!r}: {h.SERVICE_CLASS} cannot name another")
    return None


# ------------------------------------------------------------------ a tenant's turns


class OwnedRun(Protocol):
    """A run as a run book knows it: the caller whose turns it carries."""

    caller: str


def turn_identity(tenant: KeyIdentity | None, service_class: str, caller: str) -> tuple[str, str]:
    """A turn's class and caller: a tenant's are its key's (the class only where the key
    names one), whatever its headers say; anyone else's (``tenant`` None) as its headers
    say (``service_class`` and ``caller``, read from them)."""
    if tenant is None:
        return service_class, caller
    return tenant.service_class or service_class, tenant.caller


def may_join(tenant: KeyIdentity | None, run: OwnedRun | None) -> bool:
    """Whether a turn may join ``run`` (None: a run not known here, which the turn starts):
    a tenant's only its own caller's runs; anyone else's (``tenant`` None) any run."""
    return tenant is None or run is None or run.caller == tenant.caller


def sees(tenant: KeyIdentity | None, run: OwnedRun) -> bool:
    """Whether a request may see (or end) ``run``: a tenant only its own caller's runs;
    anyone else every run."""
    return tenant is None or run.caller == tenant.caller


def may_end(tenant: KeyIdentity | None, run: OwnedRun | None) -> bool:
    """Whether a request may end ``run`` (None: a run not known here): a tenant only one of
    its own caller's; anyone else any run."""
    return tenant is None or (run is not None and sees(tenant, run))


def named_other_callers_run(which: str) -> str:
    """The 403's message when a tenant's turn names (by ``which`` header) another caller's run."""
    return f"{which} names a run of another caller: a tenant's turns join only its own runs"


def no_run_of_this_caller(run_id: str) -> str:
    """The 404's message when a tenant ends a run that is not its own (or not known here)."""
    return f"no run {run_id!r} of this caller"
