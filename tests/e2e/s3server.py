"""moto's standalone S3 server as a process of its own, for MILLM_STORAGE=s3 end to end: a real
HTTP endpoint that the web and engine processes reach through boto3 as they would reach S3, and
that the tests read behind the server's back (`keys`, `read`). Nothing here talks to AWS."""

import contextlib
import subprocess
import sys
from pathlib import Path

import boto3
import httpx

from tests.e2e.stack import ROOT, free_port, wait_until

# Fake credentials: moto accepts any; boto3 refuses to sign a request without some.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "millm-test-key", "AWS_SECRET_ACCESS_KEY": "millm-test-secret"}
REGION = "us-east-1"


class S3Server:
    name = "moto_server"  # what wait_until calls the process when it dies before it answers

    def __init__(self, log_dir, bucket):
        self.bucket = bucket
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"moto-s3-{self.port}.log"
        self.popen = None

    def start(self):
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            )
        wait_until(self._answers, 30, f"moto's S3 server did not answer on {self.url}", self)
        self.client().create_bucket(Bucket=self.bucket)

    @property
    def alive(self):
        return self.popen.poll() is None

    def log(self):
        return self.log_path.read_text(errors="replace")

    def _answers(self):
        return httpx.get(self.url + "/moto-api/", timeout=2).status_code == 200

    def stop(self):
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def settings(self, location="millm"):
        """The settings (environment variables) that point miServer's storage at this bucket."""
        return {
            "MILLM_STORAGE": "s3",
            "AWS_STORAGE_BUCKET_NAME": self.bucket,
            "AWS_S3_ENDPOINT_URL": self.url,
            "AWS_S3_REGION_NAME": REGION,
            "AWS_LOCATION": location,
            **CREDENTIALS,
        }

    def client(self):
        return boto3.client(
            "s3", endpoint_url=self.url, region_name=REGION,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )

    def keys(self, prefix=""):
        """Every object key in the bucket under `prefix`, sorted."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", ()))

    def read(self, key):
        return self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()


@contextlib.contextmanager
def s3_server(log_dir, bucket="millm-test"):
    """moto's S3 server on a free port with one empty bucket; stopped after."""
    server = S3Server(log_dir, bucket)
    try:
        server.start()
        yield server
    finally:
        server.stop()
