"""No key reaches a log: uvicorn's WebSocket handshake lines carry the query, `?token=<key>`
included, and millm_site.redaction rewrites it (tests/e2e/test_projects.py greps real logs)."""

import logging

from millm_site.redaction import RedactTokens


def test_a_token_in_a_logged_path_is_redacted_and_the_rest_kept(caplog):
    logger = logging.getLogger("test.redaction")
    logger.addFilter(RedactTokens())
    with caplog.at_level(logging.INFO, logger="test.redaction"):
        logger.info('%s - "WebSocket %s" [accepted]', "127.0.0.1:5", "/ws/batches/?a=1&token=mk_secret-key_9&b=2")
        logger.info("nothing to hide: %s", "/ws/batches/")
    assert "mk_secret-key_9" not in caplog.text
    assert '"WebSocket /ws/batches/?a=1&token=[redacted]&b=2" [accepted]' in caplog.text
    assert "nothing to hide: /ws/batches/" in caplog.text
