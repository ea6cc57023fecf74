"""A real HTTP server on 127.0.0.1 that speaks OpenAI's `/v1/chat/completions` and answers from a script.

Used to test RULER through litellm exactly as it runs against a hosted judge: real sockets, real JSON, nothing
patched. The judge reads the `<trajectory id="N">` blocks of the prompt and scores each from a `points=K`
marker in it (score K/10), so a test knows which score belongs to which trajectory whatever order the reply
uses. `script` holds the behaviour for the next requests (one entry per request); when it is empty `default`
answers (`good` unless a test sets it). Every request body is kept in `requests`, its arrival time
(`time.monotonic()`) in `arrivals`.

Besides replies, a behaviour can return a `Reply` (any status, headers and body: a 429 with `Retry-After`, a
503, an HTML page) or a `Stall` (never answer; or send headers and then a byte now and then, forever), so the
judge's failure modes are tested over real sockets too.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from artnb.backends.ports import free_port

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


@dataclass(frozen=True)
class Reply:
    """A raw HTTP answer instead of a chat completion: a dict body is sent as JSON, a str as HTML."""

    status: int
    body: dict[str, Any] | str = ""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Stall:
    """`hang`: never answer. `trickle`: send headers, then a space every 0.1 s, never finishing the body.
    Either lasts until the client goes away or the server stops (at most `seconds`)."""

    kind: Literal["hang", "trickle"]
    seconds: float = 60.0


def error_body(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": None, "param": None}}


def rate_limited(retry_after: str | None = "1") -> Callable[[dict[str, Any]], Reply]:
    """HTTP 429, with a `Retry-After` header unless `retry_after` is None."""
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return lambda body: Reply(429, error_body("Rate limit reached for requests", "rate_limit_error"), headers)


def server_error(status: int = 500) -> Callable[[dict[str, Any]], Reply]:
    return lambda body: Reply(status, error_body("the judge is overloaded", "server_error"))


def refused(status: int = 401) -> Callable[[dict[str, Any]], Reply]:
    """A client error: 401 a wrong key, 400 a request the server will not take."""
    message = "Incorrect API key provided" if status == 401 else "Invalid value for 'response_format'"
    return lambda body: Reply(status, error_body(message, "invalid_request_error"))


def garbage(body: dict[str, Any]) -> Reply:
    """HTTP 200 with an HTML page, as a misconfigured proxy in front of the judge sends."""
    return Reply(200, "<html><body><h1>502 Bad Gateway</h1></body></html>")


def no_choices(body: dict[str, Any]) -> Reply:
    """HTTP 200 with a well-formed completion whose `choices` list is empty."""
    return Reply(
        200,
        {
            "id": "chatcmpl-empty",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "judge"),
            "choices": [],
            "usage": {"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10},
        },
    )


def hang(body: dict[str, Any]) -> Stall:
    return Stall("hang")


def trickle(body: dict[str, Any]) -> Stall:
    return Stall("trickle")


def only_for(marker: str, behaviour: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    """`behaviour` for requests whose prompt contains `marker`, `good` for the others (e.g. as `default`)."""

    def reply(body: dict[str, Any]) -> Any:
        prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
        return behaviour(body) if marker in prompt else good(body)

    return reply


class FakeJudge:
    """`with FakeJudge() as judge:` serves at `judge.url` (an OpenAI base URL) until the block ends."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.arrivals: list[float] = []
        self.script: deque[Callable[[dict[str, Any]], Any]] = deque()
        self.default: Callable[[dict[str, Any]], Any] = good
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._closing = False
        config = uvicorn.Config(
            self._app(),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="fake-openai", daemon=True)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            self.arrivals.append(time.monotonic())
            behaviour = self.script.popleft() if self.script else self.default
            reply = behaviour(body)
            if asyncio.iscoroutine(reply):
                reply = await reply
            if isinstance(reply, Reply):
                if isinstance(reply.body, str):
                    return Response(reply.body, reply.status, reply.headers, media_type="text/html")
                return JSONResponse(reply.body, reply.status, reply.headers)
            if isinstance(reply, Stall) and reply.kind == "trickle":
                return StreamingResponse(self._trickle(reply.seconds), media_type="application/json")
            if isinstance(reply, Stall):
                await self._wait_until_gone(request, reply.seconds)
                return Response("stalled", 504)
            content = reply if isinstance(reply, str) else json.dumps({"scores": reply})
            return JSONResponse(self._completion(body, content))

        return app

    def _completion(self, body: dict[str, Any], content: str) -> dict[str, Any]:
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

    async def _wait_until_gone(self, request: Request, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._closing and time.monotonic() < deadline and not await request.is_disconnected():
            await asyncio.sleep(0.05)

    async def _trickle(self, seconds: float) -> AsyncIterator[bytes]:
        """Whitespace, which JSON allows before a value; Starlette stops it when the client disconnects."""
        deadline = time.monotonic() + seconds
        while not self._closing and time.monotonic() < deadline:
            yield b" "
            await asyncio.sleep(0.1)

    def __enter__(self) -> FakeJudge:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the fake OpenAI server did not start on port {self.port}")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing = True
        self._server.should_exit = True
        self._thread.join(timeout=10)
