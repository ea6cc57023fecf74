"""A small real MCP server for MCP·RL's tutorial and tests: notes kept in a SQLite file, four tools.

Run it as `python -m artnb.mcp.notes_server --db notes.db` (stdio). It is written with the official `mcp` SDK,
like any server a user would train against; artnb's MCP code knows nothing special about it. `--seed` fills an
empty database with a few notes, so a scenario can ask about them; `--pid-file` writes the process id (the
tests kill the server mid-rollout from outside).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
from pathlib import Path
from typing import Annotated

from pydantic import Field

SEED_NOTES = [
    ("Groceries", "milk, eggs, rye bread, coffee beans", "home"),
    ("Dentist", "appointment on Tuesday at 9:30, bring the insurance card", "health"),
    ("Book club", "read chapters 4-6 of The Left Hand of Darkness before Friday", "reading"),
    ("Bike", "the rear tyre loses air; buy a patch kit", "home"),
    ("Project Falcon", "demo moved to the 14th; Priya owns the slides", "work"),
]

# Bounded arguments: a small model's call must end (greedy decoding of an unbounded string can loop forever).
Title = Annotated[str, Field(max_length=60)]
Body = Annotated[str, Field(max_length=300)]
Tag = Annotated[str, Field(max_length=20)]
Query = Annotated[str, Field(max_length=40)]


def open_db(path: Path, seed: bool) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False)
    db.execute("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, title TEXT, body TEXT, tag TEXT)")
    if seed and db.execute("SELECT COUNT(*) FROM notes").fetchone()[0] == 0:
        db.executemany("INSERT INTO notes (title, body, tag) VALUES (?, ?, ?)", SEED_NOTES)
    db.commit()
    return db


def build(db: sqlite3.Connection):
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError  # its message reaches the agent; others are hidden

    server = MCPServer("notes")

    def row(r: tuple) -> str:
        return f"#{r[0]} [{r[3]}] {r[1]}: {r[2]}"

    @server.tool()
    def add_note(title: Title, body: Body, tag: Tag = "misc") -> str:
        """Save a note; returns its id."""
        if not title.strip():
            raise ToolError("a note needs a title")
        cursor = db.execute("INSERT INTO notes (title, body, tag) VALUES (?, ?, ?)", (title, body, tag))
        db.commit()
        return f"saved note #{cursor.lastrowid}"

    @server.tool()
    def search_notes(query: Query) -> str:
        """Notes whose title or body contains the query (case-insensitive)."""
        like = f"%{query.lower()}%"
        rows = db.execute(
            "SELECT id, title, body, tag FROM notes WHERE lower(title) LIKE ? OR lower(body) LIKE ?",
            (like, like),
        ).fetchall()
        return "\n".join(map(row, rows)) or f"no note matches {query!r}"

    @server.tool()
    def list_notes(tag: Tag | None = None) -> str:
        """All notes, or those with one tag."""
        sql, args = "SELECT id, title, body, tag FROM notes", ()
        if tag:
            sql, args = sql + " WHERE tag = ?", (tag,)
        return "\n".join(map(row, db.execute(sql, args).fetchall())) or "no notes"

    @server.tool()
    def delete_note(note_id: int) -> str:
        """Delete a note by its id."""
        if db.execute("DELETE FROM notes WHERE id = ?", (note_id,)).rowcount == 0:
            raise ToolError(f"there is no note #{note_id}")
        db.commit()
        return f"deleted note #{note_id}"

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])  # None under python -OO
    parser.add_argument(
        "--db",
        type=Path,
        required=True,
        help="the SQLite file (created if missing), or :memory: for a fresh database each run",
    )
    parser.add_argument("--seed", action="store_true", help="fill an empty database with a few notes")
    parser.add_argument("--pid-file", type=Path, help="write this process's id here")
    options = parser.parse_args()
    if options.pid_file:
        options.pid_file.write_text(str(os.getpid()))
    build(open_db(options.db, options.seed)).run()


if __name__ == "__main__":
    main()
