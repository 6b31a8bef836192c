"""TEST DOUBLE of the ``vllm`` executable (vLLM needs a GPU and is not installed here).

It records its argv and the environment variables the adapter sets into the JSON file named by
``FAKE_VLLM_RECORD``, then serves ``/health``, ``/v1/models`` and ``/metrics`` (vLLM's names)
on ``--host``/``--port`` until SIGTERM, so the adapter's start/ready/metrics/stop path runs
against a real process.

``POST /v1/completions`` answers in vLLM's shape so ``pdbridge verify`` can run against it:
deterministic greedy tokens derived from the prompt, ``token_ids``/``prompt_token_ids`` on the
choice only with ``return_token_ids`` (vLLM >= 0.10.2), top-k ``logprobs`` only when asked,
no logits digests (vLLM has none). Each request body is appended to the record's
``requests``. ``FAKE_VLLM_OLD=1`` plays a vLLM older than 0.10.2 (no token ids);
``FAKE_VLLM_REMOTE_LOGPROB_SHIFT`` adds to every logprob after the first step of a decode leg
(``do_remote_prefill``): the same tokens with drifted numerics, what a subtly damaged
transferred KV cache can look like. Like NixlConnector, a prefill leg (``do_remote_decode``)
answers ``kv_transfer_params`` saying where its KV waits (``remote_engine_id``, block ids,
host, port), and a decode leg without a ``transfer_id`` (pull mode) that does not carry them
fails with HTTP 500, as a decode engine with nothing to fetch would.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WATCHED = (
    "CUDA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
)


def completion(body: dict, name: str) -> dict:
    """A vLLM-shaped non-streaming completion of ``body`` (greedy, deterministic)."""
    prompt_ids = list(str(body.get("prompt", "")).encode())
    n = int(body.get("max_tokens") or 16)
    if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
        n = 1  # vLLM's prefill leg: one token, the KV goes to the decoder
    seed = sum(prompt_ids)
    tokens = [(seed * 31 + 7 * i) % 1000 for i in range(n)]
    remote = (body.get("kv_transfer_params") or {}).get("do_remote_prefill")
    shift = float(os.environ.get("FAKE_VLLM_REMOTE_LOGPROB_SHIFT", "0")) if remote else 0.0
    logprobs = [-0.5 / (i + 1) + (shift if i else 0.0) for i in range(n)]
    choice: dict = {
        "index": 0,
        "text": "".join(chr(97 + t % 26) for t in tokens),
        "finish_reason": "length",
        "stop_reason": None,
        "logprobs": None,
    }
    k = body.get("logprobs")
    if k:
        choice["logprobs"] = {
            "tokens": [str(t) for t in tokens],
            "token_logprobs": logprobs,
            "top_logprobs": [
                {str(t + j): lp - j for j in range(int(k))}
                for t, lp in zip(tokens, logprobs, strict=True)
            ],
        }
    if body.get("return_token_ids") and os.environ.get("FAKE_VLLM_OLD") != "1":
        choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = tokens
    extra: dict = {}
    if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
        extra["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"{name}-engine",
            "remote_block_ids": [0, 1],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        }
    return {
        **extra,
        "id": "cmpl-fake",
        "object": "text_completion",
        "model": name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": n,
            "total_tokens": len(prompt_ids) + n,
        },
    }


def main() -> None:
    argv = sys.argv[1:]
    record: dict = {"argv": argv, "env": {k: os.environ.get(k) for k in WATCHED}, "requests": []}
    lock = threading.Lock()

    def save() -> None:
        with open(os.environ["FAKE_VLLM_RECORD"], "w") as handle:
            json.dump(record, handle)

    save()
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

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self.send_error(404)
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                record["requests"].append(body)
                save()
            kv = body.get("kv_transfer_params") or {}
            status = 200
            if (
                kv.get("do_remote_prefill")
                and "transfer_id" not in kv
                and not kv.get("remote_engine_id")
            ):
                status = 500
                data = json.dumps({"error": {"message": "no remote KV to fetch"}}).encode()
            else:
                data = json.dumps(completion(body, name)).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

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
