"""A connection to an MCP server started as a subprocess over stdio, through the official `mcp` SDK.

Why a wrapper: a rollout needs three things from the server (its tools as OpenAI tools, a tool call that returns
text, and a clear error when the server is gone), and the SDK's objects change names between its major versions
(`inputSchema`/`input_schema`, `isError`/`is_error`). `connect(...)` gives those three, and a server that dies
raises `MCPServerError` naming the command, the call and the end of its stderr, instead of the SDK's bare
"connection closed".

Each `async with connect(...)` starts its own server process, so each rollout can own a fresh server (and the
state behind it, e.g. a database file) and concurrent rollouts never see each other's changes.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, cast

from .types import MCPResource, MCPTool


class MCPServerError(RuntimeError):
    """The MCP server could not be started, or stopped answering."""


@dataclass
class ToolResult:
    """What a tool call returned: its text (content blocks joined) and whether the server flagged an error."""

    text: str
    is_error: bool = False


class MCPConnection:
    """An initialised session with one running server: its tools and resources, and `call_tool`."""

    def __init__(self, session: Any, command: str, stderr_path: Path, call_timeout_s: float) -> None:
        self.session, self.command, self.stderr_path = session, command, stderr_path
        self.call_timeout_s = call_timeout_s
        self.tools: list[MCPTool] = []
        self.resources: list[MCPResource] = []

    def openai_tools(self) -> list[dict[str, Any]]:
        """The server's tools in a chat request's `tools` format."""
        return [tool.to_openai() for tool in self.tools]

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> ToolResult:
        """Call a tool. An unknown tool or a failure inside it is a ToolResult with `is_error` (the agent sees
        the message, as it would from any server); a server that is gone raises MCPServerError."""
        if name not in {t.name for t in self.tools}:
            known = ", ".join(t.name for t in self.tools)
            return ToolResult(f"unknown tool {name!r}; the tools are: {known}", is_error=True)
        try:
            result = await self.session.call_tool(
                name, arguments or {}, read_timeout_seconds=self.call_timeout_s
            )
        except Exception as error:
            if _is_protocol_error(error):
                return ToolResult(f"{type(error).__name__}: {error}", is_error=True)
            raise MCPServerError(self._died(f"tools/call {name}", error)) from error
        texts = [_block_text(block) for block in getattr(result, "content", None) or []]
        flagged = bool(getattr(result, "is_error", getattr(result, "isError", False)))
        return ToolResult("\n".join(texts), is_error=flagged)

    async def _list(self) -> None:
        listed = await self.session.list_tools()
        self.tools = [
            MCPTool(
                name=t.name,
                description=t.description or "",
                parameters=getattr(t, "input_schema", None) or getattr(t, "inputSchema", None) or {},
            )
            for t in listed.tools
        ]
        with contextlib.suppress(Exception):  # a server without resources answers with an error
            resources = await self.session.list_resources()
            self.resources = [
                MCPResource(
                    uri=str(r.uri),
                    name=r.name or "",
                    description=r.description or "",
                    mimeType=getattr(r, "mime_type", None) or getattr(r, "mimeType", None),
                )
                for r in resources.resources
            ]

    def _died(self, during: str, error: BaseException) -> str:
        tail = _tail(self.stderr_path)
        return (
            f"the MCP server `{self.command}` stopped answering during {during} ({type(error).__name__}: "
            f"{error or 'connection closed'})" + (f"; the end of its stderr:\n{tail}" if tail else "")
        )


@contextlib.asynccontextmanager
async def connect(
    command: str,
    args: Sequence[str] = (),
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    call_timeout_s: float = 60.0,
) -> AsyncIterator[MCPConnection]:
    """Start `command args...` as an MCP server over stdio, initialise it and list its tools.

    env: variables for the server on top of the SDK's default environment (PATH, HOME, ...); the notebook's own
    variables (API keys) are not passed on unless given here.

    >>> async with art.mcp.connect(sys.executable, ["-m", "artnb.mcp.notes_server", "--db", "notes.db"]) as server:
    ...     result = await server.call_tool("search_notes", {"query": "milk"})
    """
    try:
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client
    except ImportError as error:
        raise ImportError("art.mcp needs the MCP SDK: pip install 'artnb[mcp]'") from error
    # The SDK's default environment (PATH, HOME, ...) plus `env`: a third-party server does not get the notebook's
    # API keys unless they are passed here.
    params = StdioServerParameters(
        command=command, args=list(args), env=dict(env or {}), cwd=str(cwd) if cwd else None
    )
    shown = " ".join([Path(command).name, *args])
    with tempfile.NamedTemporaryFile("w+", prefix="artnb-mcp-", suffix=".log", delete=False) as stderr:
        stderr_path = Path(stderr.name)
        try:
            async with (
                # typeshed does not declare the temporary file's wrapper a TextIO, though it proxies one
                stdio_client(params, errlog=cast(TextIO, stderr)) as (read, write),
                ClientSession(read, write) as session,
            ):
                connection = MCPConnection(session, shown, stderr_path, call_timeout_s)
                try:
                    await session.initialize()
                    await connection._list()
                except Exception as error:
                    raise MCPServerError(connection._died("initialize", error)) from error
                yield connection
        except OSError as error:
            raise MCPServerError(f"could not start the MCP server `{shown}`: {error}") from error
        finally:
            with contextlib.suppress(OSError):
                stderr_path.unlink()


async def list_tools(command: str, args: Sequence[str] = (), **options: Any) -> list[MCPTool]:
    """Start the server, list its tools, stop it (e.g. to generate scenarios before training)."""
    async with connect(command, args, **options) as server:
        return list(server.tools)


def python_server(module: str, *args: str) -> tuple[str, list[str]]:
    """(command, args) that run `python -m module args...` with this interpreter."""
    return sys.executable, ["-m", module, *args]


def _block_text(block: Any) -> str:
    text = getattr(block, "text", None)
    if isinstance(text, str):
        return text
    dump = block.model_dump(exclude_none=True) if hasattr(block, "model_dump") else block
    return json.dumps(dump, default=str)


def _is_protocol_error(error: BaseException) -> bool:
    """An error the server answered with (bad arguments, a tool that raised), as opposed to a dead server."""
    return (
        type(error).__name__ in {"McpError", "MCPError", "ToolError"} and "closed" not in str(error).lower()
    )


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
