"""Keys never reach a log. A browser's WebSocket carries its key in the query (`?token=`, it cannot
set headers), and uvicorn logs every WebSocket handshake's path with its query at INFO, even with
the access log off: a filter on its logger rewrites `token=<key>` before anything is written."""

import logging
import re

TOKEN = re.compile(r"([?&]token=)[^&\s\"']+")


class RedactTokens(logging.Filter):
    def filter(self, record):
        message = record.getMessage()
        redacted = TOKEN.sub(r"\1[redacted]", message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


def install(*logger_names):
    for name in logger_names:
        logging.getLogger(name).addFilter(RedactTokens())
