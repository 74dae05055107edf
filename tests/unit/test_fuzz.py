"""Fuzzing the parsers that read what other peers and files send (pure, bounded, deterministic): frame
headers and payloads, the inbox, peer records, plans, topology, join and address files, the state server.

Every input is accepted, or refused with the parser's own error (FrameError, SchemaError) in one clear
line that names the field; nothing else escapes, and what is accepted holds its invariants (see
tests/fuzz_targets.py, which benchmarks/fuzz.py runs for longer). The gRPC API is fuzzed in
tests/integration/test_fuzz_api.py: it needs a server.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import given

from fuzz_targets import fuzz_settings, targets

TARGETS = targets()


@pytest.fixture(scope="module", autouse=True)
def quiet():
    """Refused frames are logged as warnings, thousands of them here: not worth formatting."""
    logger = logging.getLogger("hetpeer")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


@fuzz_settings(400)
@given(TARGETS["frame_header"].strategy)
def test_frame_headers_decode_consistently_or_are_refused_with_a_frame_error(frame):
    TARGETS["frame_header"].run(frame)


@fuzz_settings(300)
@given(TARGETS["payload"].strategy)
def test_payloads_decode_to_finite_tensors_of_their_header_or_are_refused(case):
    TARGETS["payload"].run(case)


@fuzz_settings(100)
@given(TARGETS["inbox"].strategy)
def test_the_inbox_counts_every_refusal_and_delivers_every_accepted_frame(case):
    TARGETS["inbox"].run(case)


@fuzz_settings(200)
@given(TARGETS["peer_record"].strategy)
def test_peer_records_parse_and_round_trip_or_are_refused_naming_the_field(raw):
    TARGETS["peer_record"].run(raw)


@fuzz_settings(200)
@given(TARGETS["plan"].strategy)
def test_plans_and_plan_records_parse_and_round_trip_or_are_refused_naming_the_field(case):
    TARGETS["plan"].run(case)


@fuzz_settings(200)
@given(TARGETS["topology"].strategy)
def test_topology_files_give_finite_links_or_are_refused_naming_the_field(raw):
    TARGETS["topology"].run(raw)


@fuzz_settings(150)
@given(TARGETS["join"].strategy)
def test_join_files_parse_or_are_refused_naming_the_field(case):
    TARGETS["join"].run(case)


@fuzz_settings(150)
@given(TARGETS["addresses"].strategy)
def test_address_books_parse_and_round_trip_or_are_refused_naming_the_field(raw):
    TARGETS["addresses"].run(raw)


@fuzz_settings(150)
@given(TARGETS["state_server"].strategy)
def test_the_state_server_answers_only_what_it_holds_to_whom_asked_and_never_raises(offered):
    TARGETS["state_server"].run(offered)
