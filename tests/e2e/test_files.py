"""The Files API through the openai client and raw HTTP, against real uvicorn."""

import json
import socket

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families



def jsonl(rows):
    return "".join(json.dumps({"custom_id": f"row-{i}", "n": i}) + "\n" for i in range(rows)).encode()


def test_the_openai_client_uploads_lists_retrieves_downloads_and_deletes(client):
    body = jsonl(3)
    created = client.files.create(file=("rows.jsonl", body), purpose="batch")
    assert created.id.startswith("file-") and len(created.id) == 29
    assert (created.object, created.purpose, created.status, created.bytes) == ("file", "batch", "processed", len(body))
    assert created.filename == "rows.jsonl"
    assert created.expires_at - created.created_at == 30 * 86_400

    assert client.files.retrieve(created.id).bytes == len(body)
    content = client.files.content(created.id)
    assert content.content == body
    assert content.response.headers["content-type"] == "application/jsonl"

    deleted = client.files.delete(created.id)
    assert deleted.deleted is True and deleted.id == created.id
    with pytest.raises(openai.NotFoundError) as caught:
        client.files.retrieve(created.id)
    assert caught.value.code == "file_not_found"
    assert created.id not in [file.id for file in client.files.list(purpose="batch")]


def test_listing_pages_with_a_cursor_newest_first(client):
    ids = [client.files.create(file=(f"page-{i}.jsonl", jsonl(1)), purpose="batch").id for i in range(5)]
    first = client.files.list(limit=2)
    assert len(first.data) == 2 and first.has_more is True
    seen = [file.id for file in client.files.list(limit=2)]  # auto-paging follows `after`
    assert [file_id for file_id in seen if file_id in ids] == list(reversed(ids))
    ascending = [file.id for file in client.files.list(limit=3, order="asc") if file.id in ids]
    assert ascending == ids


def test_the_same_idempotency_key_answers_the_first_file(client, stack):
    headers = {"Idempotency-Key": "upload-once-42"}
    first = client.files.create(file=("a.jsonl", jsonl(1)), purpose="batch", extra_headers=headers)
    second = client.files.create(file=("b.jsonl", jsonl(2)), purpose="batch", extra_headers=headers)
    assert second.id == first.id and second.filename == "a.jsonl"
    assert stack.sql("SELECT count(*) FROM files_app_file WHERE filename = 'b.jsonl'")[0][0] == 0


def test_a_non_utf8_file_is_stored_byte_for_byte(client):
    body = b'{"custom_id": "caf\xe9"}\n\xff\xfe\n'
    created = client.files.create(file=("latin.jsonl", body), purpose="batch")
    assert client.files.content(created.id).content == body  # validation judges each line later


def test_an_empty_file_is_accepted_with_no_lines(client, stack):
    created = client.files.create(file=("empty.jsonl", b""), purpose="batch")
    assert created.bytes == 0
    assert stack.sql("SELECT line_count FROM files_app_file WHERE id = %s", [created.id]) == [(0,)]


def test_a_wrong_purpose_or_a_missing_file_part_is_refused(stack):
    wrong = httpx.post(stack.web.url + "/v1/files", data={"purpose": "fine-tune"}, files={"file": ("x.jsonl", b"{}\n")})
    assert wrong.status_code == 400
    assert (wrong.json()["error"]["code"], wrong.json()["error"]["param"]) == ("invalid_batch_request", "purpose")
    missing = httpx.post(stack.web.url + "/v1/files", data={"purpose": "batch"}, files={"other": ("x", b"1")})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "file"
    not_multipart = httpx.post(stack.web.url + "/v1/files", data={"purpose": "batch"})
    assert not_multipart.status_code == 415
    assert not_multipart.json()["error"]["code"] == "unsupported_media_type"
    assert "multipart/form-data" in not_multipart.json()["error"]["message"]


def test_a_bad_expires_after_names_the_field(stack):
    response = httpx.post(
        stack.web.url + "/v1/files",
        data={"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "60"},
        files={"file": ("x.jsonl", b"{}\n")},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "expires_after[seconds]"
    assert "3,600" in response.json()["error"]["message"]


def test_expires_after_sets_the_expiry(client):
    created = client.files.create(
        file=("short.jsonl", jsonl(1)), purpose="batch", expires_after={"anchor": "created_at", "seconds": 7200}
    )
    assert created.expires_at - created.created_at == 7200


def test_an_unknown_file_is_404_everywhere(stack):
    for method, path in [("GET", "/v1/files/file-nope"), ("GET", "/v1/files/file-nope/content"), ("DELETE", "/v1/files/file-nope")]:
        response = httpx.request(method, stack.web.url + path)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "file_not_found"


# --- limits, on a web process of their own with small limits ---

LIMITS = {"BATCH_MAX_FILE_BYTES": 1000, "BATCH_MAX_ROWS": 5, "BATCH_MAX_LINE_BYTES": 300}


@pytest.fixture(scope="module")
def limited(stack):
    web = stack.start_web(**LIMITS)
    yield web
    web.stop()


def upload(web, body):
    return httpx.post(web.url + "/v1/files", data={"purpose": "batch"}, files={"file": ("f.jsonl", body)}, timeout=60)


def state(stack):
    return stack.sql("SELECT count(*) FROM files_app_file")[0][0], stack.stored_files(), sorted((stack.data_dir / "tmp").iterdir())


FOUR_LINES_OF_250 = (b"x" * 249 + b"\n") * 4  # exactly 1,000 bytes


@pytest.mark.parametrize(
    "at_limit,over,setting,measured",
    [
        (FOUR_LINES_OF_250, FOUR_LINES_OF_250 + b"y", "BATCH_MAX_FILE_BYTES", "at least 1,001 bytes"),
        (b"{}\n" * 5, b"{}\n" * 6, "BATCH_MAX_ROWS", "at least 6 lines"),
        (b"{}\n" * 4 + b"{}", b"{}\n" * 5 + b"{}", "BATCH_MAX_ROWS", "at least 6 lines"),
        (b"x" * 300 + b"\n", b"x" * 301 + b"\n", "BATCH_MAX_LINE_BYTES", "line 1 is at least 301 bytes"),
    ],
    ids=["bytes", "rows", "rows-without-final-newline", "line"],
)
def test_each_limit_admits_the_limit_and_refuses_one_over_storing_nothing(stack, limited, at_limit, over, setting, measured):
    accepted = upload(limited, at_limit)
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["bytes"] == len(at_limit)
    before = state(stack)
    refused = upload(limited, over)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "batch_file_limit" and error["param"] == "file"
    assert setting in error["message"] and f"{LIMITS[setting]:,}" in error["message"]
    assert measured in error["message"]
    assert state(stack) == before  # no record, no bytes, no temporary file


def test_a_declared_content_length_over_the_limit_is_refused_before_any_byte_is_read(limited):
    host, port = limited.url.removeprefix("http://").split(":")
    declared = 1000 + (1 << 20) + 1
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            f"Content-Length: {declared}\r\n\r\n".encode()
        )
        answer = b""
        while chunk := sock.recv(65536):  # the refusal closes the connection when it is done
            answer += chunk
        answer = answer.decode()  # no body was sent: the refusal cannot have read one
    assert answer.startswith("HTTP/1.1 400")
    assert "batch_file_limit" in answer and f"{declared:,} bytes declared" in answer


def file_posts_answered(web):
    """{status: count} of the POST /v1/files answers this web process has sent (its /metrics)."""
    text = httpx.get(web.url + "/metrics", timeout=10).text
    answered = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (sample.name == "millm_http_requests_total" and labels.get("method") == "POST"
                    and "v1/files" in labels.get("route", "")):
                answered[labels["status"]] = answered.get(labels["status"], 0) + sample.value
    return answered


def test_an_undeclared_body_is_refused_once_it_crosses_the_limit(stack, limited):
    before, answered = state(stack), file_posts_answered(limited)
    sent = []

    def chunks():
        yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="f.jsonl"\r\n\r\n'
        for _ in range(64):  # 4 MiB, far over 1,000 bytes plus the 1 MiB framing allowance
            sent.append(1)
            yield b"x" * 65536

    try:
        response = httpx.post(limited.url + "/v1/files", content=chunks(),
                              headers={"Content-Type": "multipart/form-data; boundary=b"}, timeout=30)
    except httpx.HTTPError:
        response = None  # the server may close before the client has finished sending
    if response is not None:
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "batch_file_limit"
    # Whether or not the client read the answer, the server sent one: a 400, and nothing else.
    after = file_posts_answered(limited)
    assert {status: count - answered.get(status, 0) for status, count in after.items()
            if count != answered.get(status, 0)} == {"400": 1}
    assert state(stack) == before
