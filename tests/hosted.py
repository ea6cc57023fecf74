"""A hosted chat model (OpenAI, OpenRouter) played by a real HTTP server on 127.0.0.1, for the calls artnb makes
to paid services: scripted replies, and every request kept (body and headers) so a test can see where it went. The `scripted` fixture (conftest.py) makes them."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedModel:
    """Answers request i with replies[i] (the last one again when the script runs out): a string is the
    assistant's reply, an int an HTTP error status as a provider sends it."""

    def __init__(self, replies: list[str | int]) -> None:
        self.replies, self.requests, self.headers = replies, [], []
        script = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                script.requests.append(body)
                script.headers.append({k.lower(): v for k, v in self.headers.items()})
                content = script.replies[min(len(script.requests), len(script.replies)) - 1]
                if isinstance(content, int):
                    status, reply = content, {"error": {"message": "Incorrect API key provided"}}
                else:
                    status, reply = 200, completion(content, body["model"], len(script.requests))
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.server.server_port}/v1"
        self.params = {"api_base": self.base_url, "api_key": "test-key"}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def completion(content: str, model: str, number: int) -> dict:
    """An OpenAI chat.completion body with `content` as the assistant's reply."""
    return {
        "id": f"chatcmpl-{number}",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70},
    }
