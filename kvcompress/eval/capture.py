"""A real-prose source, and (re-exported from `integration.capture`) real q/k/v capture.

`prose_paragraphs` / `prose_text` give natural-language text that ships with every CPython: the
prose paragraphs of the Python language reference topics in `pydoc_data.topics` (the text behind
`help("for")`), without code samples, grammar blocks or headings.
"""

from __future__ import annotations

import random
import re

from ..integration.capture import capture_qkv

__all__ = ["architecture_paragraphs", "capture_qkv", "changelog_paragraphs", "docstring_paragraphs", "idle_feature_paragraphs",
           "idle_source_paragraphs", "manual_paragraphs", "notes_paragraphs", "prose_paragraphs", "prose_text", "HELDOUT_MODULES",
           "SCORER_TRAINING_MODULES"]

# The standard-library modules whose docstrings (and their public classes' and functions') make the second prose source.
DOCSTRING_MODULES = (
    "argparse", "logging", "unittest", "json", "textwrap", "typing", "dataclasses", "functools", "collections", "subprocess",
    "threading", "pathlib", "datetime", "decimal", "fractions", "random", "statistics", "string", "re", "zipfile", "tarfile",
    "csv", "pickle", "shutil", "tempfile", "inspect", "ast", "email.message", "http.client", "urllib.request", "sqlite3",
    "heapq", "bisect", "contextlib", "enum", "abc", "io", "codecs", "locale", "gettext", "calendar", "difflib", "doctest",
    "pdb", "pprint", "queue", "sched", "selectors", "socket", "ssl", "struct", "traceback", "warnings", "weakref",
)

# Disjoint from DOCSTRING_MODULES and from the held-out set's: the text `kvcompress train-scorer` trains KVzap's
# surrogates on (`docstring_paragraphs(SCORER_TRAINING_MODULES)`).
SCORER_TRAINING_MODULES = (
    "unittest.mock", "os", "unittest.case", "asyncio.events", "asyncio.base_events", "asyncio.streams", "configparser",
    "optparse", "base64", "platform", "pydoc", "cmd", "pkgutil", "timeit", "xml.etree.ElementTree", "site", "code",
    "importlib.metadata", "ipaddress", "graphlib", "bz2", "lzma", "mailbox", "zipimport", "xml.dom.minidom",
    "collections.abc", "gzip", "venv", "shelve", "logging.config", "pstats", "tokenize", "profile", "getopt", "pickletools",
    "uuid", "symtable", "filecmp", "unittest.loader", "sysconfig", "hashlib",
)

# The held-out text KVzap's fidelity is reported on (`benchmarks/kvzap_fidelity.py`): no training, tuning or choice
# reads it.
HELDOUT_MODULES = (
    "logging.handlers", "http.cookiejar", "smtplib", "http.server", "urllib.parse", "imaplib", "ftplib", "socketserver",
    "mimetypes", "email.utils", "email.parser", "email.headerregistry", "xmlrpc.client", "wsgiref.handlers", "http.cookies",
)


def _is_prose(paragraph: str) -> bool:
    """A paragraph of running text: unindented, several words, mostly letters, ends a sentence."""
    if paragraph.startswith((" ", "*", "-", "+", "=")) or len(paragraph.split()) < 8:
        return False
    letters = sum(ch.isalpha() or ch.isspace() for ch in paragraph)
    return letters >= 0.85 * len(paragraph) and paragraph.rstrip().endswith((".", ":", "?", "!"))


def prose_paragraphs() -> list[str]:
    """Prose paragraphs of the Python language reference (`pydoc_data.topics`), in a fixed order.

    Line breaks inside a paragraph become spaces; paragraphs ending with ':' (which introduce a
    code sample that was removed) are dropped, and so are repeats (several topics share text).
    """
    from pydoc_data.topics import topics

    out: dict[str, None] = {}
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            if _is_prose(block) and not block.rstrip().endswith(":"):
                out.setdefault(" ".join(block.split()))
    return list(out)


def prose_text(n_chars: int | None = None, seed: int | None = None) -> str:
    """Real prose joined by blank lines: the paragraphs in order (seed None) or shuffled by `seed`.

    n_chars: stop at the first paragraph boundary at or after n_chars characters, cycling through
    the paragraphs again if needed; None returns every paragraph once.
    """
    paragraphs = prose_paragraphs()
    if seed is not None:
        random.Random(seed).shuffle(paragraphs)
    if n_chars is None:
        return "\n\n".join(paragraphs)
    if n_chars < 0:
        raise ValueError(f"n_chars must be >= 0, got {n_chars}")
    parts: list[str] = []
    total = 0
    while total < n_chars:
        for p in paragraphs:
            parts.append(p)
            total += len(p) + 2
            if total >= n_chars:
                break
    return "\n\n".join(parts)


def docstring_paragraphs(modules: tuple[str, ...] = DOCSTRING_MODULES) -> list[str]:
    """Prose paragraphs of the docstrings of `modules` and of their own public classes and functions, in a fixed order.
    With `DOCSTRING_MODULES`: a second real-prose source that ships with every CPython, for tuning samples
    (`eval.tasks`, split "tuning"); with `SCORER_TRAINING_MODULES`: KVzap's training text. Paragraphs are chosen as
    `prose_paragraphs` chooses them; any that `prose_paragraphs` also has is left out.
    """
    import importlib
    import inspect
    import warnings

    reference = set(prose_paragraphs())
    out: dict[str, None] = {}
    with warnings.catch_warnings():  # reading deprecated aliases (typing.re, typing.io) warns
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in modules:
            module = importlib.import_module(name)
            members = [getattr(module, attr) for attr in sorted(dir(module)) if not attr.startswith("_")]
            own = [m for m in members if (inspect.isclass(m) or inspect.isfunction(m)) and getattr(m, "__module__", None) == name]
            for obj in [module] + own:
                for block in re.split(r"\n\s*\n", inspect.getdoc(obj) or ""):
                    paragraph = " ".join(block.split())
                    if _is_prose(block) and not block.rstrip().endswith(":") and paragraph not in reference:
                        out.setdefault(paragraph)
    return list(out)


# The second held-out needle set's text (`notes_paragraphs`): CPython's licence, then IDLE's plain-text files, in this order.
NOTES_FILES = ("LICENSE.txt", "idlelib/NEWS.txt", "idlelib/README.txt", "idlelib/CREDITS.txt", "idlelib/HISTORY.txt",
               "idlelib/TODO.txt", "idlelib/extend.txt")
# The issue tag a news entry starts with ("gh-104486: ", "bpo-45495: ", once without its colon), dropped from the sentence.
_NEWS_TAG = re.compile(r"^(?:gh|bpo)-\d+:?\s*")


def notes_paragraphs() -> list[str]:
    """Prose paragraphs of CPython's licence (`LICENSE.txt`) and of IDLE's plain-text notes and news (`NOTES_FILES`,
    shipped with CPython beside the standard library), in that order, each news entry without its issue tag: the second
    held-out needle set's text (`eval.tasks`, split "heldout2"), which no tuning, training, reported or first held-out
    sample uses. Paragraphs are chosen as `prose_paragraphs` chooses them; a Python without these files is a clear error."""
    root = _shipped(NOTES_FILES, "the second held-out set's prose is CPython's licence and IDLE's notes")
    out: dict[str, None] = {}
    for name in NOTES_FILES:
        for block in re.split(r"\n\s*\n", (root / name).read_text(encoding="utf-8")):
            paragraph = _NEWS_TAG.sub("", " ".join(block.split()))
            if _is_prose(block) and not block.rstrip().endswith(":") and paragraph:
                out.setdefault(paragraph)
    return list(out)


# The third held-out needle set's text (`changelog_paragraphs`): IDLE's news of its 2.x releases, then IDLEfork's CVS
# change log, in this order.
CHANGELOG_FILES = ("idlelib/NEWS2x.txt", "idlelib/ChangeLog")
# What an entry of these files starts with, dropped from its paragraph: a list bullet ("- ", "+ "), or "* " and the files
# a change log entry names ("* PyShell.py, idle: "), then an issue tag ("Issue #4455: ", "Bug #813342: ", "Patch #1362975: ").
_ENTRY_LEAD = re.compile(r"^(?:[-+]\s+|\*\s+(?:[\w.,/ -]+:\s+)?)?(?:(?:Issue|Bug|Patch)\s*#?\d+:\s*)?")


def changelog_paragraphs() -> list[str]:
    """Prose paragraphs of IDLE's news of its 2.x releases and of IDLEfork's change log (`CHANGELOG_FILES`, shipped with
    CPython beside the standard library), in that order, each entry without its bullet, file names and issue tag: the third
    held-out needle set's text (`eval.tasks`, split "heldout3"), which no tuning, training, reported or earlier held-out
    sample uses. A paragraph is kept as `prose_paragraphs` keeps one, judged on its text once the lead is dropped; a Python
    without these files is a clear error."""
    root = _shipped(CHANGELOG_FILES, "the third held-out set's prose is IDLE's 2.x news and IDLEfork's change log")
    out: dict[str, None] = {}
    for name in CHANGELOG_FILES:
        for block in re.split(r"\n\s*\n", (root / name).read_text(encoding="utf-8")):
            paragraph = _ENTRY_LEAD.sub("", " ".join(block.split()), count=1)
            if _is_prose(paragraph) and not paragraph.endswith(":"):
                out.setdefault(paragraph)
    return list(out)


# The fourth held-out needle set's text (`architecture_paragraphs`): the email package's notes on its architecture, then
# IDLE's notes on its tests, in this order, then the docstrings of ARCHITECTURE_MODULES.
ARCHITECTURE_FILES = ("email/architecture.rst", "idlelib/idle_test/README.txt")
# Standard-library modules in none of DOCSTRING_MODULES, SCORER_TRAINING_MODULES, HELDOUT_MODULES and
# benchmarks/tuning/scorer_inputs.py's EXTRA_MODULES, with long prose docstrings: the two files alone hold about 2,700
# tokens (the default model's tokenizer) of sentences, too few for a 4096-token sample that repeats none; with these, 6,268.
ARCHITECTURE_MODULES = ("email._header_value_parser", "email._encoded_words", "email._parseaddr")
# Where the two files' paragraphs part: a blank line, or the "---" line that fences a sample in IDLE's README.
_FILE_BREAK = re.compile(r"\n\s*\n|\n---\n")
# A definition list's term ("Model", "header_source_parse"): a word alone on the first line, its definition indented below.
_DEFINITION_TERM = re.compile(r"^( *)\w+\n\1 +(?=\S)")
# reStructuredText's inline markup, each with the text it leaves: an RFC role (":rfc:`5322`") "RFC" and the number; a role
# marked "~" (":class:`~email.message.Message`") its target's last name, any other role its target; literals and
# interpreted text (``cte_type=7bit``, `Message`) and emphasis (*primarily*) their text.
_RST_INLINE = (
    (re.compile(r":rfc:`+(\d+)`+"), r"RFC \1"),
    (re.compile(r":\w+:`~(?:[\w.]*\.)?([^`.]+)`"), r"\1"),
    (re.compile(r":\w+:`([^`]+)`"), r"\1"),
    (re.compile(r"`+([^`]+)`+"), r"\1"),
    (re.compile(r"\*(\w[^*]*)\*"), r"\1"),
)


def architecture_paragraphs() -> list[str]:
    """Prose paragraphs of the email package's notes on its architecture and of IDLE's notes on its tests
    (`ARCHITECTURE_FILES`, shipped with CPython in the standard library), then of the docstrings of `ARCHITECTURE_MODULES`
    (the module's and every class's and function's in its source, in source order, read with `ast`: nothing is imported),
    in that order: the fourth held-out needle set's text (`eval.tasks`, split "heldout4"), which no tuning, training,
    reported or earlier held-out sample uses. A file's paragraph is kept without a definition list's term, a list bullet
    or reStructuredText's inline markup, as `prose_paragraphs` keeps one, judged on its text once they are dropped; a
    docstring's as `docstring_paragraphs` keeps one. A Python without these files is a clear error."""
    modules = _source_files(ARCHITECTURE_MODULES)
    root = _shipped(ARCHITECTURE_FILES + modules, "the fourth held-out set's prose is the email package's architecture notes, "
                    "IDLE's test notes and the email package's parsers' docstrings")
    out: dict[str, None] = {}
    for name in ARCHITECTURE_FILES:
        for block in _FILE_BREAK.split((root / name).read_text(encoding="utf-8")):
            paragraph = re.sub(r"^[-+*]\s+", "", " ".join(_DEFINITION_TERM.sub("", block, count=1).split()), count=1)
            for markup, text in _RST_INLINE:
                paragraph = markup.sub(text, paragraph)
            if _is_prose(paragraph) and not paragraph.endswith(":"):
                out.setdefault(paragraph)
    for paragraph in _source_docstring_paragraphs(root, modules):
        out.setdefault(paragraph)
    return list(out)


# The fifth held-out needle set's text (`idle_source_paragraphs`): the docstrings of IDLE's own modules, in this order.
# Modules in none of DOCSTRING_MODULES, SCORER_TRAINING_MODULES, HELDOUT_MODULES, ARCHITECTURE_MODULES and
# benchmarks/tuning/scorer_inputs.py's EXTRA_MODULES, among the unread modules with the longest prose docstrings, no
# sentence of which another text has: 7,579 tokens (the default model's tokenizer) of sentences, the fourth set's 6,268.
IDLE_SOURCE_MODULES = ("idlelib.configdialog", "idlelib.config", "idlelib.redirector", "idlelib.codecontext",
                       "idlelib.squeezer", "idlelib.format", "idlelib.multicall")


def idle_source_paragraphs() -> list[str]:
    """Prose paragraphs of the docstrings of IDLE's own modules (`IDLE_SOURCE_MODULES`, shipped with CPython in the
    standard library: the module's and every class's and function's in its source, in source order, read with `ast`:
    nothing is imported), in that order: the fifth held-out needle set's text (`eval.tasks`, split "heldout5"), which no
    tuning, training, reported or earlier held-out sample uses. A paragraph is kept as `docstring_paragraphs` keeps one,
    and once; a Python without these files is a clear error."""
    return _shipped_docstring_paragraphs(IDLE_SOURCE_MODULES,
                                         "the fifth held-out set's prose is the docstrings of IDLE's modules")


# The sixth held-out needle set's text (`idle_feature_paragraphs`): the docstrings of the modules of IDLE's features (its
# search dialogs, shell, debugger, browsers, call tips, ...), in this order. Modules in none of DOCSTRING_MODULES,
# SCORER_TRAINING_MODULES, HELDOUT_MODULES, ARCHITECTURE_MODULES, IDLE_SOURCE_MODULES and
# benchmarks/tuning/scorer_inputs.py's EXTRA_MODULES, no sentence of which another text has (idlelib.editor repeats two of
# idlelib.format's), the fewest of those with the longest prose docstrings that outweigh the fifth set's text: 7,748 tokens
# (the default model's tokenizer) of sentences, the fifth set's 7,579.
IDLE_FEATURE_MODULES = ("idlelib.searchbase", "idlelib.search", "idlelib.replace", "idlelib.grep", "idlelib.pyparse",
                        "idlelib.rpc", "idlelib.colorizer", "idlelib.help", "idlelib.query", "idlelib.calltip",
                        "idlelib.browser", "idlelib.pyshell", "idlelib.macosx", "idlelib.searchengine", "idlelib.outwin",
                        "idlelib.run", "idlelib.autocomplete", "idlelib.sidebar", "idlelib.hyperparser",
                        "idlelib.debugger_r", "idlelib.runscript", "idlelib.debugger", "idlelib.parenmatch",
                        "idlelib.history", "idlelib.tree", "idlelib.textview")


def idle_feature_paragraphs() -> list[str]:
    """Prose paragraphs of the docstrings of the modules of IDLE's features (`IDLE_FEATURE_MODULES`: its search dialogs,
    shell, debugger, browsers, call tips, ..., shipped with CPython in the standard library), read as
    `idle_source_paragraphs` reads its modules', in that order: the sixth held-out needle set's text (`eval.tasks`, split
    "heldout6"), which no tuning, training, reported or earlier held-out sample uses. A paragraph is kept as
    `docstring_paragraphs` keeps one, and once; a Python without these files is a clear error."""
    return _shipped_docstring_paragraphs(IDLE_FEATURE_MODULES, "the sixth held-out set's prose is the docstrings of the "
                                         "modules of IDLE's features")


def _shipped_docstring_paragraphs(modules: tuple[str, ...], what: str) -> list[str]:
    """The prose paragraphs of the docstrings of the standard library's `modules` (`_source_docstring_paragraphs`), each
    once, in order; FileNotFoundError (`_shipped`, naming `what`) where this Python lacks one of their files."""
    files = _source_files(modules)
    return list(dict.fromkeys(_source_docstring_paragraphs(_shipped(files, what), files)))


def _source_files(modules: tuple[str, ...]) -> tuple[str, ...]:
    """Each module's source file under the standard library's folder ("email._parseaddr" -> "email/_parseaddr.py")."""
    return tuple(name.replace(".", "/") + ".py" for name in modules)


def _source_docstring_paragraphs(root, files: tuple[str, ...]):
    """The prose paragraphs of the docstrings in the source files `files` (paths under `root`), in order: each file's
    module's, then every class's and function's in source order, read with `ast` (nothing is imported); a paragraph is
    yielded, its whitespace collapsed, where `docstring_paragraphs` keeps one (repeats too: the caller drops them)."""
    import ast

    for name in files:
        tree = ast.parse((root / name).read_text(encoding="utf-8"))
        defined = (node for node in ast.walk(tree) if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
        for node in [tree] + sorted(defined, key=lambda node: node.lineno):
            for block in re.split(r"\n\s*\n", ast.get_docstring(node) or ""):
                if _is_prose(block) and not block.rstrip().endswith(":"):
                    yield " ".join(block.split())


def _shipped(names: tuple[str, ...], what: str):
    """The standard library's folder (`sysconfig`'s "stdlib" path), once every file of `names` is found under it;
    FileNotFoundError naming the missing ones, after `what` (the text they make), otherwise."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    missing = [name for name in names if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{what} ({', '.join(names)} under {root}); this Python does not ship {', '.join(missing)} "
                                "(some distributions package idlelib apart: install it, e.g. the idle-python3 package)")
    return root


def manual_paragraphs() -> list[str]:
    """Prose paragraphs of IDLE's user manual (`idlelib/help.html`, shipped with CPython), in document order: the held-out
    needle set's text (`eval.tasks`, split "heldout"), a body of prose no tuning, training or reported sample uses.
    Each `<p>` element's text with its whitespace collapsed, kept as `prose_paragraphs` keeps paragraphs; a Python without
    idlelib is a clear error."""
    import importlib.util
    from html.parser import HTMLParser
    from pathlib import Path

    spec = importlib.util.find_spec("idlelib")
    path = Path(spec.origin).parent / "help.html" if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError("the held-out prose is IDLE's user manual, idlelib/help.html, which this Python does not ship "
                                "(some distributions package idlelib apart: install it, e.g. the idle-python3 package)")

    class Paragraphs(HTMLParser):
        def __init__(self):
            super().__init__()
            self.paragraphs: list[str] = []
            self.current: list[str] | None = None

        def handle_starttag(self, tag, attrs):
            if tag == "p":
                self.current = []

        def handle_endtag(self, tag):
            if tag == "p" and self.current is not None:
                self.paragraphs.append("".join(self.current))
                self.current = None

        def handle_data(self, data):
            if self.current is not None:
                self.current.append(data)

    parser = Paragraphs()
    parser.feed(path.read_text(encoding="utf-8"))
    out: dict[str, None] = {}
    for block in parser.paragraphs:
        if _is_prose(block) and not block.rstrip().endswith(":"):
            out.setdefault(" ".join(block.split()))
    return list(out)
