"""The batch-file upload handler: limits enforced while the bytes stream in, never held whole.

Django's multipart parser hands the `file` part to this handler chunk by chunk; the chunks go to
a temporary file on disk while bytes, lines and the longest line are counted, and the upload is
refused the moment a limit is crossed. Nothing is stored after a refusal: the temporary file is
removed before the error leaves.
"""

from django.conf import settings
from django.core.files.uploadedfile import TemporaryUploadedFile
from django.core.files.uploadhandler import FileUploadHandler

from files_app.models import disk_full
from millm_lib.errors import ApiError

FILE_FIELD = "file"
# Room for the multipart framing around the file: the boundaries, the parts' headers and the small
# fields (purpose, expires_after). The body limit allows this much over BATCH_MAX_FILE_BYTES, and
# a body's Content-Length less this much is the least its file can be.
MULTIPART_ALLOWANCE = 1 << 20


def least_file_bytes(content_length):
    """The least size of the file a multipart body of `content_length` can hold; None when the
    body's size is not declared."""
    try:
        declared = int(content_length)
    except (TypeError, ValueError):
        return None
    return max(0, declared - MULTIPART_ALLOWANCE)


def file_limit(what, limit, setting, measured):
    return ApiError(
        400,
        "batch_file_limit",
        f"The file is over the {what} limit: {measured} (limit {limit:,}, {setting}); nothing was stored",
        param=FILE_FIELD,
    )


class LineCounter:
    """Counts bytes and `\\n`-separated lines of a stream and checks SPEC 9's three limits.

    An empty piece after the final newline is not a line; an empty file has 0 lines.
    """

    def __init__(self, max_bytes, max_rows, max_line_bytes):
        self.max_bytes, self.max_rows, self.max_line_bytes = max_bytes, max_rows, max_line_bytes
        self.size = 0
        self.complete_lines = 0
        self.current_line = 0

    def feed(self, chunk):
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise file_limit("size", self.max_bytes, "BATCH_MAX_FILE_BYTES", f"at least {self.size:,} bytes")
        start = 0
        while True:
            newline = chunk.find(b"\n", start)
            end = len(chunk) if newline < 0 else newline
            self.current_line += end - start
            if self.current_line > self.max_line_bytes:
                line = self.complete_lines + 1
                raise file_limit(
                    "line", self.max_line_bytes, "BATCH_MAX_LINE_BYTES",
                    f"line {line} is at least {self.current_line:,} bytes",
                )
            if newline < 0:
                return
            self.complete_lines += 1
            self.current_line = 0
            self._check_rows(self.complete_lines)
            start = newline + 1

    def finish(self):
        lines = self.complete_lines + (1 if self.current_line else 0)
        self._check_rows(lines)
        return lines

    def _check_rows(self, lines):
        if lines > self.max_rows:
            raise file_limit("line count", self.max_rows, "BATCH_MAX_ROWS", f"at least {lines:,} lines")


class BatchFileUploadHandler(FileUploadHandler):
    def __init__(self, request=None):
        super().__init__(request)
        self.upload = None
        self.counter = None

    def new_file(self, field_name, file_name, content_type, content_length, charset=None, content_type_extra=None):
        super().new_file(field_name, file_name, content_type, content_length, charset, content_type_extra)
        if field_name != FILE_FIELD or self.upload is not None:
            self._discard()
            raise ApiError(
                400, "invalid_batch_request",
                f"Send exactly one file, in the multipart part named 'file' (got a file part named {field_name!r})",
                param=FILE_FIELD,
            )
        try:
            self.upload = TemporaryUploadedFile(file_name or "upload.jsonl", "application/jsonl", 0, None)
        except OSError as error:
            raise disk_full(error) or error
        self.counter = LineCounter(
            settings.BATCH_MAX_FILE_BYTES, settings.BATCH_MAX_ROWS, settings.BATCH_MAX_LINE_BYTES
        )

    def receive_data_chunk(self, raw_data, start):
        try:
            self.counter.feed(raw_data)
        except ApiError:
            self._discard()
            raise
        try:
            self.upload.write(raw_data)
        except OSError as error:
            self._discard()
            raise disk_full(error) or error
        return None

    def file_complete(self, file_size):
        try:
            self.upload.line_count = self.counter.finish()
        except ApiError:
            self._discard()
            raise
        try:
            self.upload.seek(0)  # flushes what is buffered: a full disk shows here too
        except OSError as error:
            self._discard()
            raise disk_full(error) or error
        self.upload.size = file_size
        return self.upload

    def _discard(self):
        if self.upload is not None:
            try:
                self.upload.close()  # a TemporaryUploadedFile removes itself on close
            except OSError:
                pass  # the flush on close failed (a full disk); the file is removed all the same
            self.upload = None
