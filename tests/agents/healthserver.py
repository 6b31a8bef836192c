"""A small real HTTP server the agent tests supervise (a stand-in for an engine process, which
needs no model): ``/health``, ``/metrics``, and knobs to crash or to leave a grandchild.

    python -m tests.agents.healthserver --port N [--exit-after S] [--exit-code C]
        [--grandchild PIDFILE] [--ignore-term]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

UNHEALTHY_AT = [float("inf")]


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/health" and time.monotonic() >= UNHEALTHY_AT[0]:
            self.send_error(503)
            return
        if self.path == "/health":
            body = b"ok\n"
        elif self.path == "/metrics":
            body = b"# TYPE healthserver_up gauge\nhealthserver_up 1\n"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--exit-after", type=float, default=-1)
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--grandchild", default="")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--tag", default="")
    parser.add_argument("--start-delay", type=float, default=0.0)
    parser.add_argument("--unhealthy-after", type=float, default=-1)
    parser.add_argument("--preamble", type=int, default=0, help="filler lines printed first")
    args = parser.parse_args()
    if args.unhealthy_after >= 0:
        UNHEALTHY_AT[0] = time.monotonic() + args.start_delay + args.unhealthy_after
    time.sleep(args.start_delay)  # a slow engine: not healthy for a while
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.grandchild:
        # A grandchild that does not inherit the death signal: only process-group handling
        # and the agent's group record can catch it.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(args.grandchild, "w") as fh:
            fh.write(str(child.pid))
    for n in range(args.preamble):
        print(f"preamble line {n:06d} " + "." * 80)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"healthserver pid={os.getpid()} port={args.port} tag={args.tag}", flush=True)
    if args.exit_after >= 0:

        def stop_later() -> None:
            time.sleep(args.exit_after)
            print("healthserver exiting on purpose", flush=True)
            os._exit(args.exit_code)

        threading.Thread(target=stop_later, daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
