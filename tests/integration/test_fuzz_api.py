"""Fuzzing the coordinator's gRPC API on 127.0.0.1: raw random requests to each method (and to methods it
does not have) are answered or refused with a gRPC status that blames the request, and the server goes on
serving well-formed calls. The cases are in tests/fuzz_targets.py; benchmarks/fuzz.py runs them longer."""

from __future__ import annotations

import pytest
from hypothesis import given

from fuzz_targets import ApiRig, api_calls, fuzz_settings, run_api


@pytest.fixture(scope="module")
def rig():
    rig = ApiRig()
    yield rig
    rig.close()


def test_raw_requests_are_answered_or_refused_and_the_server_keeps_serving(rig):
    seen = set()

    @fuzz_settings(300)
    @given(api_calls())
    def call(case):
        seen.add(run_api(rig, case))

    call()
    rig.check_serving()
    assert {"answered", "INVALID_ARGUMENT", "UNIMPLEMENTED"} <= seen, seen  # the cases reach each outcome
