"""TEST DOUBLE of the ``vllm`` executable (vLLM needs a GPU and is not installed here).

It records its argv and the environment variables the adapter sets into the JSON file named by
``FAKE_VLLM_RECORD``, then serves ``/health``, ``/v1/models`` and ``/metrics`` (vLLM's names)
on ``--host``/``--port`` until SIGTERM, so the adapter's start/ready/metrics/stop path runs
against a real process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WATCHED = (
    "CUDA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
)


def main() -> None:
    argv = sys.argv[1:]
    record = {"argv": argv, "env": {k: os.environ.get(k) for k in WATCHED}}
    with open(os.environ["FAKE_VLLM_RECORD"], "w") as handle:
        json.dump(record, handle)
    host = argv[argv.index("--host") + 1]
    port = int(argv[argv.index("--port") + 1])
    name = argv[argv.index("--served-model-name") + 1] if "--served-model-name" in argv else argv[1]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                body, ctype = b"", "text/plain"
            elif self.path == "/v1/models":
                body, ctype = (
                    json.dumps(
                        {"object": "list", "data": [{"id": name, "object": "model"}]}
                    ).encode(),
                    "application/json",
                )
            elif self.path == "/metrics":
                body = (
                    f'vllm:num_requests_running{{model_name="{name}",engine="0"}} 2.0\n'
                    f'vllm:num_requests_waiting{{model_name="{name}",engine="0"}} 5.0\n'
                ).encode()
                ctype = "text/plain"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(0)))
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
