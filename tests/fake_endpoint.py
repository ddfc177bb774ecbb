"""A scripted OpenAI-compatible endpoint for tests: no model, answers decided per request.

``FakeEndpoint(reply)`` serves ``/v1/chat/completions`` from a thread; ``reply(prompt_id,
attempt)`` says what the ``attempt``-th request (0 first) for a prompt gets: a ``Reply`` (a
status and a JSON body, sent after ``delay_s``, or byte by byte every ``trickle_s``). The prompt
id is the request's last user message (``user_prompts`` writes prompts whose text is their id).
``asked`` counts the requests each prompt received. Anything outside ``/v1/`` (the run's
``/metrics`` samples) gets a 404, which the run takes as "no server view".
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from draftline.serving.server import Endpoint

PROMPT_TOKEN_IDS = [11, 12, 13]
OUTPUT_TOKEN_IDS = [21, 22, 23, 24]


def good_completion(prompt_id: str) -> dict:
    """A complete chat completion as vLLM gives it with ``return_token_ids``."""
    return {
        "id": f"chatcmpl-{prompt_id}", "object": "chat.completion",
        "prompt_token_ids": list(PROMPT_TOKEN_IDS),
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": f"answer to {prompt_id}",
                                 "reasoning_content": "thought"},
                     "token_ids": list(OUTPUT_TOKEN_IDS)}],
        "usage": {"prompt_tokens": len(PROMPT_TOKEN_IDS),
                  "completion_tokens": len(OUTPUT_TOKEN_IDS),
                  "total_tokens": len(PROMPT_TOKEN_IDS) + len(OUTPUT_TOKEN_IDS)},
    }


@dataclass
class Reply:
    body: dict
    status: int = 200
    delay_s: float = 0.0
    trickle_s: float | None = None  # send the body one byte at a time, this far apart


def user_prompts(path: Path, ids: list[str]) -> Path:
    with open(path, "w") as fh:
        for pid in ids:
            fh.write(json.dumps({"id": pid, "messages": [{"role": "user", "content": pid}]})
                     + "\n")
    return path


class FakeEndpoint:
    def __init__(self, reply: Callable[[str, int], Reply]):
        self.reply = reply
        self.asked: Counter[str] = Counter()
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._send(404, b'{"error": "not here"}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt_id = body["messages"][-1]["content"]
                with fake._lock:
                    attempt = fake.asked[prompt_id]
                    fake.asked[prompt_id] += 1
                reply = fake.reply(prompt_id, attempt)
                time.sleep(reply.delay_s)
                self._send(reply.status, json.dumps(reply.body).encode(), reply.trickle_s)

            def _send(self, status: int, content: bytes, trickle_s: float | None = None):
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(content)))
                    self.end_headers()
                    if trickle_s is None:
                        self.wfile.write(content)
                        return
                    for i in range(len(content)):
                        self.wfile.write(content[i:i + 1])
                        self.wfile.flush()
                        time.sleep(trickle_s)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on this request

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeEndpoint:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(f"http://127.0.0.1:{self.server.server_address[1]}/v1", "fake")
