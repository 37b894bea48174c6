"""The tiny target's training text: the Python standard library's own source.

It ships with every Python, so the build needs no download, and it is real code with real
structure, so a few minutes of training give a target whose next-token distribution is
peaked enough for speculative decoding to have something to learn. Files are split into
train and held-out by a hash of their path (stable across machines and Python patch versions).
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

# Generated tables, vendored data, GUI code and the test suite: large, repetitive or not
# representative of the code the target is asked about.
EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "tkinter",
        "turtledemo",
        "encodings",
        "pydoc_data",
        "ensurepip",
        "__pycache__",
    }
)
HELDOUT_ONE_IN = 20

SYSTEM_PROMPT = "You are a concise Python assistant."
COMPLETE_ASKS = (
    "Complete this Python function:\n```python\n{head}\n```",
    "Write the body of this function.\n\n{head}",
)


@dataclass(frozen=True)
class Source:
    """One standard-library file: its path relative to the stdlib root, and its text."""

    path: str
    text: str


def is_heldout(rel_path: str) -> bool:
    """About one file in twenty is held out, chosen by a hash of its relative path."""
    return int(hashlib.sha256(rel_path.encode()).hexdigest(), 16) % HELDOUT_ONE_IN == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_paths() -> list[str]:
    """Relative paths of the corpus files under the stdlib root, sorted."""
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # never walk site-packages
        rel = Path(dirpath).relative_to(root)
        found += [(rel / f).as_posix() for f in filenames if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return sorted(found)


def corpus_paths(max_files: int | None = None) -> tuple[list[str], list[str]]:
    """(train, held-out) relative paths. ``max_files`` caps the train files (the first in sorted
    order) and keeps ``max(1, max_files // 10)`` held-out files, for quick test builds."""
    paths = stdlib_paths()
    train = [p for p in paths if not is_heldout(p)]
    heldout = [p for p in paths if is_heldout(p)]
    if max_files is not None:
        train, heldout = train[:max_files], heldout[: max(1, max_files // 10)]
    return train, heldout


def read_sources(rel_paths: list[str]) -> list[Source]:
    root = stdlib_root()
    return [Source(p, (root / p).read_text(encoding="utf-8", errors="replace")) for p in rel_paths]


def completion_chats(sources: list[Source], limit: int) -> list[list[dict[str, str]]]:
    """Up to ``limit`` chats "complete this function" (user: signature and docstring, assistant:
    the body), from functions of 4 to 40 lines, picked by a hash of their location so the
    choice does not depend on the order or number of files."""
    found: list[tuple[str, str, str]] = []
    for src in sources:
        try:
            tree = ast.parse(src.text)
        except SyntaxError:
            continue
        lines = src.text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            has_doc = ast.get_docstring(node) is not None
            body = node.body[1:] if has_doc else node.body
            end = node.end_lineno or node.lineno
            if not body or not 4 <= end - node.lineno + 1 <= 40 or body[0].lineno <= node.lineno:
                continue
            code = textwrap.dedent("".join(lines[node.lineno - 1 : end])).splitlines(keepends=True)
            n_head = body[0].lineno - node.lineno
            key = hashlib.sha256(f"{src.path}:{node.lineno}".encode()).hexdigest()
            found.append((key, "".join(code[:n_head]).rstrip("\n"), "".join(code[n_head:]).rstrip("\n")))
    chats = []
    for key, head, body in sorted(found)[:limit]:
        pick = int(key[:8], 16)
        chat = [
            {"role": "user", "content": COMPLETE_ASKS[pick % len(COMPLETE_ASKS)].format(head=head)},
            {"role": "assistant", "content": body},
        ]
        if pick % 3 == 0:
            chat.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        chats.append(chat)
    return chats
