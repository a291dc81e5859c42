import http_sfv

from inference_app.provenance import ignored_fields_header, provenance_headers
from inference_app.schemas import parse_request


def test_headers_for_a_seeded_chat():
    parsed = parse_request("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": 9, "user": "u"}, False)
    headers = provenance_headers("m", parsed.endpoint, parsed.request, parsed.ignored)
    assert headers == {
        "X-miLLM-Model": "m",
        "X-miLLM-Backend": "serial",
        "X-miLLM-Seed": '9;scope="request"',
        "X-miLLM-Batch": "1",
        "X-miLLM-Ignored-Fields": '"user"',
    }


def test_embeddings_carry_no_batch_or_seed_header():
    parsed = parse_request("/v1/embeddings", {"model": "m", "input": "x"}, False)
    assert provenance_headers("m", parsed.endpoint, parsed.request, parsed.ignored) == {
        "X-miLLM-Model": "m",
        "X-miLLM-Backend": "serial",
    }


def test_a_long_ignored_list_is_cut_to_1024_bytes_ending_with_a_count():
    paths = [f"field_number_{index}" for index in range(200)]
    header = ignored_fields_header(paths)
    assert len(header.encode()) <= 1024
    parsed = http_sfv.List()
    parsed.parse(header.encode())
    values = [item.value for item in parsed]
    assert values[:3] == paths[:3]
    kept = len(values) - 1
    assert values[-1] == f"+{200 - kept} more"


def test_non_ascii_field_names_still_make_a_valid_header():
    header = ignored_fields_header(["naïve"])
    parsed = http_sfv.List()
    parsed.parse(header.encode())
    assert parsed[0].value == "na\\xefve"


def test_control_characters_in_field_names_still_make_a_valid_header():
    # Found by schemathesis (tests/e2e/test_openapi.py): ASCII control characters passed the
    # non-ASCII escape and http_sfv refused them, a 500.
    header = ignored_fields_header(["a\x1bb\x7f\tc"])
    parsed = http_sfv.List()
    parsed.parse(header.encode())
    assert parsed[0].value == "a\\x1bb\\x7f\\tc"
