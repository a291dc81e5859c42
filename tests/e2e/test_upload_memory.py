"""A 200 MB upload, and its download, must not grow the uvicorn web process by more than a few tens
of MB."""

import httpx


GROWTH_BOUND_MB = 64


def peak_rss_mb(pid):
    for row in open(f"/proc/{pid}/status"):
        if row.startswith("VmHWM:"):
            return int(row.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def write_batch_file(path, lines=50_000, line_bytes=4_194):
    """50,000 lines of 4,194 bytes: 209,700,000 bytes, just under BATCH_MAX_FILE_BYTES."""
    pad = "x" * (line_bytes - 1 - len('{"custom_id": "r00000", "pad": ""}'))
    with open(path, "w") as handle:
        for index in range(lines):
            handle.write(f'{{"custom_id": "r{index:05d}", "pad": "{pad}"}}\n')
    return path.stat().st_size


def test_a_200_mb_upload_and_its_download_keep_the_web_process_small(stack, tmp_path):
    size = write_batch_file(tmp_path / "big.jsonl")
    assert 200_000_000 < size <= 209_715_200
    web = stack.start_web()
    httpx.get(web.url + "/v1/files?limit=1")  # warm: imports and the first query are not the upload
    before = peak_rss_mb(web.popen.pid)
    with open(tmp_path / "big.jsonl", "rb") as handle:
        response = httpx.post(web.url + "/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", handle)}, timeout=300)
    assert response.status_code == 200, response.text
    assert response.json()["bytes"] == size
    growth = peak_rss_mb(web.popen.pid) - before
    print(f"web peak RSS {before:.0f} MB before, +{growth:.1f} MB during a {size / 1e6:.0f} MB upload")
    assert growth < GROWTH_BOUND_MB
    lines = stack.sql("SELECT line_count FROM files_app_file WHERE id = %s", [response.json()["id"]])
    assert lines == [(50_000,)]

    # Under ASGI, Django reads a plain FileResponse whole before it sends a byte: the content
    # goes as an asynchronous stream instead (millm_lib/streaming.py).
    received = 0
    with httpx.stream("GET", f"{web.url}/v1/files/{response.json()['id']}/content", timeout=300) as download:
        assert download.status_code == 200
        for chunk in download.iter_bytes():
            received += len(chunk)
    assert received == size
    growth = peak_rss_mb(web.popen.pid) - before
    print(f"web peak RSS +{growth:.1f} MB after the download too")
    assert growth < GROWTH_BOUND_MB
    web.stop()
