"""A webhook receiver for tests: a real HTTP server in a thread that records each request (path,
headers, raw body, arrival time) and answers from a script per path."""

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    path: str
    headers: dict
    body: bytes
    at: float = field(default_factory=time.monotonic)


@dataclass
class Answer:
    status: int = 200
    headers: dict = field(default_factory=dict)
    body: bytes = b"ok"
    delay: float = 0.0  # seconds before answering at all (a receiver that never answers: a long one)


class Receiver:
    """`script(path, answers)`: the answers a path gives, in order; the last one repeats. Every
    other path answers 200."""

    def __init__(self):
        self.received = []
        self._scripts = {}
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver._lock:
                    receiver.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    answers = receiver._scripts.get(self.path) or [Answer()]
                    answer = answers.pop(0) if len(answers) > 1 else answers[0]
                time.sleep(answer.delay)
                try:
                    self.send_response(answer.status)
                    for name, value in answer.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(answer.body)))
                    self.end_headers()
                    self.wfile.write(answer.body)
                except OSError:
                    pass  # the sender gave up (a timeout, or it read enough of a large answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # A short poll: `shutdown` waits for the loop's next poll (half a second by default).
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def script(self, path, *answers):
        with self._lock:
            self._scripts[path] = list(answers)

    def at(self, path):
        with self._lock:
            return [request for request in self.received if request.path == path]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
