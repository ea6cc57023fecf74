"""A real HTTP server on 127.0.0.1 that speaks OpenAI's `/v1/chat/completions` and answers from a script.

Used to test RULER through litellm exactly as it runs against a hosted judge: real sockets, real JSON, nothing
patched. The judge reads the `<trajectory id="N">` blocks of the prompt and scores each from a `points=K`
marker in it (score K/10), so a test knows which score belongs to which trajectory whatever order the reply
uses. `script` holds the behaviour for the next requests (one entry per request); when it is empty the judge
answers well. Every request body is kept in `requests`.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request

_TRAJECTORY = re.compile(r'<trajectory id="([^"]+)">(.*?)</trajectory>', re.DOTALL)
_POINTS = re.compile(r"points=(\d+)")

Scores = list[dict[str, Any]]


def read_prompt(body: dict[str, Any]) -> list[tuple[str, float]]:
    """(id, score) for each trajectory of the first user message; no marker scores 0.5."""
    prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
    out = []
    for tid, text in _TRAJECTORY.findall(prompt):
        points = _POINTS.findall(text)
        out.append((tid, int(points[-1]) / 10 if points else 0.5))
    return out


def good(body: dict[str, Any]) -> Scores:
    """Every id once, in reverse order (so matching by position would be wrong)."""
    return [{"trajectory_id": tid, "explanation": f"earned {s}", "score": s} for tid, s in read_prompt(body)][
        ::-1
    ]


def wrong_count(body: dict[str, Any]) -> Scores:
    return good(body)[1:]


def duplicate_id(body: dict[str, Any]) -> Scores:
    scores = good(body)
    return [*scores[:-1], {**scores[-1], "trajectory_id": scores[0]["trajectory_id"]}]


def unknown_id(body: dict[str, Any]) -> Scores:
    return [*good(body), {"trajectory_id": "99", "explanation": "?", "score": 0.5}]


def score_out_of_range(body: dict[str, Any]) -> Scores:
    scores = good(body)
    scores[0]["score"] = 7.0
    return scores


def malformed(body: dict[str, Any]) -> str:
    return '{"scores": [{"trajectory_id": "1", "expl'


def slow(seconds: float, then: Callable[[dict[str, Any]], Any] = good) -> Callable[[dict[str, Any]], Any]:
    async def reply(body: dict[str, Any]) -> Any:
        await asyncio.sleep(seconds)
        return then(body)

    return reply


class FakeJudge:
    """`with FakeJudge() as judge:` serves at `judge.url` (an OpenAI base URL) until the block ends."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.script: deque[Callable[[dict[str, Any]], Any]] = deque()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._server = uvicorn.Server(
            uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        )
        self._thread = threading.Thread(target=self._server.run, name="fake-openai", daemon=True)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.requests.append(body)
            behaviour = self.script.popleft() if self.script else good
            reply = behaviour(body)
            if asyncio.iscoroutine(reply):
                reply = await reply
            content = reply if isinstance(reply, str) else json.dumps({"scores": reply})
            return {
                "id": f"chatcmpl-fake{len(self.requests)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "judge"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
            }

        return app

    def __enter__(self) -> FakeJudge:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the fake OpenAI server did not start on port {self.port}")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
