"""Streamed answers. Stored bytes: under ASGI, Django reads a synchronous iterator (a plain
FileResponse's) whole into memory before it sends a byte, so the bytes go as an asynchronous
iterator, read in a worker thread a chunk at a time. Server-sent events: `event_stream`."""

from asgiref.sync import sync_to_async
from django.http import FileResponse, StreamingHttpResponse

CHUNK_BYTES = 256 * 1024


def file_response(handle, **kwargs):
    """A FileResponse for `handle` (its headers, and closing the handle when sent) whose body
    is read `CHUNK_BYTES` at a time."""
    response = FileResponse(handle, **kwargs)
    response.streaming_content = _chunks(handle)
    return response


async def _chunks(handle):
    read = sync_to_async(handle.read, thread_sensitive=False)
    while chunk := await read(CHUNK_BYTES):
        yield chunk


def event_stream(events, headers):
    """A server-sent events answer of `events` (an async iterator of their text) with `headers`,
    unbuffered by proxies and caches."""
    response = StreamingHttpResponse(events, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    for name, value in headers.items():
        response[name] = value
    return response
