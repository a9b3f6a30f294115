"""The bearer-token check the server and the router share."""

from loraplex.bearer import bearer, carries_token

TOKEN = "admin-token-0123456789"


def test_bearer_reads_the_token_of_a_bearer_header_only():
    assert bearer(f"Bearer {TOKEN}") == TOKEN
    assert bearer(f"bearer  {TOKEN} ") == TOKEN  # the scheme in any case, spaces around the token
    assert bearer(None) is None and bearer("") is None and bearer("Bearer ") is None
    assert bearer(f"Basic {TOKEN}") is None


def test_carries_token_compares_the_whole_token():
    assert carries_token(f"Bearer {TOKEN}", TOKEN)
    assert not carries_token(f"Bearer {TOKEN[:-1]}", TOKEN)
    assert not carries_token(f"Bearer {TOKEN}x", TOKEN)
    assert not carries_token(None, TOKEN) and not carries_token(TOKEN, TOKEN)
    assert not carries_token("Bearer tökén-with-non-ascii", TOKEN)  # refused, not a TypeError
