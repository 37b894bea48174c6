"""The tiny target's training text: the Python standard library's own source, or other Python
source folders (installed packages) for a target built on other code.

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
        "_vendor",
        "vendor",
        "vendored",
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
    """One source file: its key (see `python_files`), and its text."""

    path: str
    text: str


def is_heldout(rel_path: str, one_in: int = HELDOUT_ONE_IN) -> bool:
    """About one file in `one_in` is held out, chosen by a hash of its relative path."""
    return int(hashlib.sha256(rel_path.encode()).hexdigest(), 16) % one_in == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_files(roots: list[str | Path] | None = None) -> dict[str, Path]:
    """Python files under `roots` (default: the standard library), keyed by a path that is the same
    on every machine: relative to the stdlib root for the default, else `<root folder name>/<path
    inside it>` (e.g. `pip/_internal/main.py` for a site-packages folder `.../pip`). Generated
    tables, tests, vendored and GUI code are skipped (`EXCLUDED_DIRS`); sorted by key."""
    tops = [(stdlib_root(), "")] if roots is None else [(Path(r), Path(r).name + "/") for r in roots]
    found: dict[str, Path] = {}
    for top, prefix in tops:
        if not top.is_dir():
            raise FileNotFoundError(f"source folder {top} does not exist")
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # never walk site-packages
            rel = Path(dirpath).relative_to(top)
            for name in filenames:
                if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                    found[prefix + (rel / name).as_posix()] = Path(dirpath) / name
    return dict(sorted(found.items()))


def corpus_paths(max_files: int | None = None, roots: list[str | Path] | None = None) -> tuple[list[str], list[str]]:
    """(train, held-out) file keys of `python_files(roots)`. ``max_files`` caps the train files (the
    first in sorted order) and keeps ``max(1, max_files // 10)`` held-out files, for quick test builds."""
    keys = list(python_files(roots))
    train = [p for p in keys if not is_heldout(p)]
    heldout = [p for p in keys if is_heldout(p)]
    if max_files is not None:
        train, heldout = train[:max_files], heldout[: max(1, max_files // 10)]
    return train, heldout


def read_sources(keys: list[str], roots: list[str | Path] | None = None) -> list[Source]:
    files = python_files(roots)
    return [Source(k, files[k].read_text(encoding="utf-8", errors="replace")) for k in keys]


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
