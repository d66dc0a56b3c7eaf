"""API keys as both ends of an HTTP call see them: any text that a header can carry, as UTF-8.

An `Authorization` header carries bytes. A key outside ASCII travels as its UTF-8 bytes (what
weightsync's client sends, and what curl sends for UTF-8 text), and the server compares those
bytes; a key with a control character or surrounding spaces could not survive a header at all,
so it is refused where it is configured.
"""

from __future__ import annotations

from weightsync.errors import EngineConfigError

__all__ = ["bearer", "check_api_key"]


def check_api_key(key: object, *, name: str) -> None:
    """Refuses a key no `Authorization` header could carry intact.

    Args:
        key: The key, or None for none.
        name: How the message names it (`"admin_api_key"`, say).

    Raises:
        EngineConfigError: Not a string, empty, with spaces around it, or with a control
            character (a line break, say).
    """
    if key is None:
        return
    if not isinstance(key, str) or not key:
        raise EngineConfigError(f"{name} must be a non-empty string, or None for none")
    if key != key.strip() or any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        raise EngineConfigError(
            f"{name} cannot travel in an HTTP header: it has spaces around it or a control "
            "character; give a key of printable characters (any language: it is sent as UTF-8)"
        )


def bearer(key: str) -> bytes:
    """The `Authorization` header value for `key`: its UTF-8 bytes after `Bearer `."""
    return b"Bearer " + key.encode("utf-8")
