"""A threaded HTTP server on 127.0.0.1 for the tests of the remote reward clients and the reward
server: each test starts its own, on a free port, and closes it."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LoopbackServer:
    """Answers every POST with `answer(path, body) -> (status, payload bytes)`, or with nothing
    when `answer` returns None (the connection is then closed unanswered). `requests` records each
    request as (path, headers, body)."""

    def __init__(self, answer, get=None):
        """`get(path, headers) -> (status, payload bytes)` answers GETs, when given (else 501)."""
        self.requests = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            if get is not None:

                def do_GET(self):
                    status, payload = get(self.path, dict(self.headers))
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests.append((self.path, dict(self.headers), body))
                try:
                    reply = answer(self.path, body)
                    if reply is None:
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    status, payload = reply
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:  # the client gave up waiting
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "LoopbackServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
