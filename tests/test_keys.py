"""The one reading of a presented key (millm_lib.keys), shared by HTTP, WebSocket and Socket.IO."""

from millm_lib.keys import bearer_token, key_is_valid, socket_key


def test_a_bearer_header_gives_its_key_and_anything_else_none():
    assert bearer_token("Bearer sk-1") == "sk-1"
    assert bearer_token(b"bearer  sk-2 ") == "sk-2"
    assert bearer_token("Basic abc") == ""
    assert bearer_token("") == ""


def test_a_socket_key_comes_from_auth_then_the_header_then_the_query():
    assert socket_key("Bearer from-header", "token=from-query", {"token": "from-auth"}) == "from-auth"
    assert socket_key("Bearer from-header", "token=from-query") == "from-header"
    assert socket_key(b"", b"token=from-query") == "from-query"
    assert socket_key("", "") == ""
    assert socket_key("Bearer from-header", "", {"token": 12345}) == ""  # a non-string token is no key


def test_keys_compare_whole():
    assert key_is_valid("sk-1", ["sk-0", "sk-1"])
    assert not key_is_valid("sk-", ["sk-1"])
