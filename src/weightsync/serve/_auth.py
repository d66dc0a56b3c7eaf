"""Bearer-key checks: the admin key guards the RL routes, the API key guards `/v1`."""

from __future__ import annotations

import hmac

from fastapi import Request

from weightsync.serve._errors import RequestRefused


def _check_bearer(request: Request, keys: list[str], what: str, flag: str) -> None:
    """Raises a 401 unless the request carries `Authorization: Bearer <one of keys>`.

    The header is compared as the bytes the client sent (the server decodes headers as
    Latin-1, which gives them back unchanged) against each key's UTF-8 bytes, so a key outside
    ASCII works when sent as UTF-8.
    """
    header = request.headers.get("authorization", "").encode("latin-1")
    scheme, _, given = header.partition(b" ")
    if not header:
        raise RequestRefused(
            401,
            f"{what} need an API key: send the header 'Authorization: Bearer <key>' with the "
            f"key given to {flag}",
            param="Authorization",
        )
    # Every key is compared, in constant time, so the answer's timing says nothing about them.
    matches = [hmac.compare_digest(given.strip(), key.encode("utf-8")) for key in keys]
    if scheme.lower() != b"bearer" or not any(matches):
        raise RequestRefused(
            401,
            f"{what}: the key in the Authorization header is wrong (expected 'Bearer <key>' with "
            f"the key given to {flag})",
            param="Authorization",
        )


def require_admin_key(request: Request) -> None:
    """FastAPI dependency of the RL routes: the admin key, when the server has one."""
    key = request.app.state.serve.config.admin_api_key
    if key:
        _check_bearer(request, [key], "the RL routes", "--admin-api-key")


def require_api_key(request: Request) -> None:
    """FastAPI dependency of the `/v1` routes: the API key (or the admin key), when set."""
    config = request.app.state.serve.config
    if config.api_key:
        keys = [config.api_key] + ([config.admin_api_key] if config.admin_api_key else [])
        _check_bearer(request, keys, "the /v1 routes", "--api-key")
