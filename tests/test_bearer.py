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


def test_carries_token_takes_it_as_a_basic_password_too():
    import base64

    def basic(text: str) -> str:
        return "Basic " + base64.b64encode(text.encode()).decode()

    assert carries_token(basic(f"trainer:{TOKEN}"), TOKEN)
    assert carries_token(basic(f":{TOKEN}"), TOKEN)  # any user name, an empty one too
    assert not carries_token(basic(f"{TOKEN}:x"), TOKEN)  # the user name is not the password
    assert not carries_token(basic(TOKEN), TOKEN)  # no colon: no password
    assert not carries_token(basic(f"trainer:{TOKEN}x"), TOKEN)
    assert not carries_token("Basic !!not-base64!!", TOKEN)
    assert not carries_token("Basic " + base64.b64encode(b"u:\xff\xfe").decode(), TOKEN)
