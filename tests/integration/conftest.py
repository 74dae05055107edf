"""Fixtures of the integration tier."""

from __future__ import annotations

import pytest

from hetpeer.coordinator.api import ApiServer


@pytest.fixture
def serve():
    """serve(get_view, cls=ApiServer, **options) -> a started API server (on 127.0.0.1 unless `listen` says
    otherwise; `tls`) serving `get_view()`; shut down after."""
    servers = []

    def start(get_view, cls=ApiServer, **options) -> ApiServer:
        server = cls(get_view, **options)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown(0)
