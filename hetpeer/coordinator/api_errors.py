"""The errors of the coordinator's API, at either end: each one line that says what failed and where.

They sit below the API's modules: `tls.py` raises `ApiTlsError` for files that do not load, `api.py`
raises `ApiError` for a port it cannot serve on, and `api_client.py` raises both.
"""

from __future__ import annotations


class ApiError(RuntimeError):
    """The API could not be served or reached, or it answered something that does not parse."""


class ApiTlsError(ApiError):
    """TLS set up wrong at either end: files that do not read, parse or match, or a client and a server
    that do not agree (one speaks TLS, the other not; a certificate the client does not trust)."""
