"""Action class from the tool name and command text, as the predictor sees it before a run.

`classify_action` is pure: it looks only at the tool an agent called and the text it sent. A
shell command is cut into simple commands at `&&`, `||`, `;`, `|`, `&` and newlines (heredoc
bodies are dropped first); each simple command is classified by its program and arguments,
and the command as a whole gets the heaviest class found, in the order of `ACTION_CLASSES`
(so `cd x && pip install -e . && pytest -x | tail` is a test run).
"""

from __future__ import annotations

import functools
import logging
import re
import shlex
from typing import Final, Literal, get_args

logger = logging.getLogger(__name__)

ActionClass = Literal[
    "test_runner",
    "package_install",
    "compiler",
    "interpreter",
    "vcs",
    "file_edit",
    "search",
    "file_read",
    "other",
]

# Heaviest first (the Literal's order): a mixed command is labelled by the earliest one.
ACTION_CLASSES: Final[tuple[ActionClass, ...]] = get_args(ActionClass)

_TOOL_CLASSES: Final[dict[str, ActionClass]] = {
    "read": "file_read",
    "notebookread": "file_read",
    "edit": "file_edit",
    "multiedit": "file_edit",
    "write": "file_edit",
    "notebookedit": "file_edit",
    "str_replace_editor": "file_edit",
    "grep": "search",
    "glob": "search",
    "ls": "search",
}
_SHELL_TOOLS: Final = frozenset({"bash", "shell", "sh", "execute", "run", "terminal", ""})

_TEST_PROGRAMS: Final = frozenset(
    {"pytest", "py.test", "tox", "nox", "jest", "mocha", "vitest", "ctest", "nosetests", "trial"}
)
_TEST_SCRIPTS: Final = re.compile(r"(^|/)(runtests?|run_tests?|test)(\.py|\.sh)?$")
_INSTALLERS: Final = frozenset(
    {
        "pip",
        "pip3",
        "uv",
        "poetry",
        "conda",
        "mamba",
        "pipx",
        "npm",
        "yarn",
        "pnpm",
        "gem",
        "apt",
        "apt-get",
        "apk",
        "yum",
        "dnf",
        "brew",
        "cargo",
        "go",
    }
)
_INSTALL_VERBS: Final = frozenset({"install", "add", "sync", "ci", "get", "develop"})
_COMPILERS: Final = frozenset(
    {
        "gcc",
        "g++",
        "cc",
        "c++",
        "clang",
        "clang++",
        "make",
        "cmake",
        "ninja",
        "tsc",
        "javac",
        "rustc",
        "mvn",
        "gradle",
        "meson",
        "bazel",
        "cython",
    }
)
_BUILD_VERBS: Final = frozenset({"build", "build_ext", "compile", "bdist_wheel", "sdist", "wheel"})
_INTERPRETERS: Final = re.compile(r"^(python[0-9.]*|pypy[0-9.]*|ipython|node|ruby|perl|Rscript)$")
_SEARCH: Final = frozenset(
    {
        "grep",
        "egrep",
        "fgrep",
        "rg",
        "ag",
        "ack",
        "find",
        "ls",
        "tree",
        "locate",
        "fd",
        "which",
        "whereis",
        "du",
    }
)
_READ: Final = frozenset(
    {
        "cat",
        "head",
        "tail",
        "less",
        "more",
        "nl",
        "wc",
        "awk",
        "diff",
        "stat",
        "file",
        "od",
        "xxd",
        "strings",
        "bat",
        "jq",
    }
)
_EDIT: Final = frozenset(
    {"patch", "tee", "mv", "cp", "rm", "mkdir", "touch", "ln", "chmod", "truncate"}
)
_VCS: Final = frozenset({"git", "hg", "svn"})
# Words that only wrap the real program: `sudo timeout 60 env X=1 pytest`.
_WRAPPERS: Final = frozenset(
    {"sudo", "time", "timeout", "nice", "env", "nohup", "exec", "xargs", "command"}
)
_SEPARATORS: Final = frozenset({"&&", "||", "|", ";", "&", ";;", "(", ")", "|&"})
_REDIRECTIONS: Final = frozenset({">", ">>", "<", ">&", "<&", "&>", "&>>", "<<<", ">|"})
_HEREDOC: Final = re.compile(r"<<-?\s*(['\"]?)(\w+)\1[^\n]*\n.*?\n\s*\2\s*(?:\n|$)", re.DOTALL)


def classify_action(tool: str, command: str) -> ActionClass:
    """The class of one action: by the tool for structured tools, by the text for shell ones."""
    key = tool.strip().lower()
    if key in _TOOL_CLASSES:
        return _TOOL_CLASSES[key]
    if key not in _SHELL_TOOLS:
        return "other"
    best: ActionClass = "other"
    for segment in _segments(command):
        found = _classify_simple(segment)
        if ACTION_CLASSES.index(found) < ACTION_CLASSES.index(best):
            best = found
    return best


@functools.lru_cache(maxsize=8192)
def command_key(command: str) -> str:
    """What a command runs, without its decoration: two runs with the same key do the same work.

    The simple commands that give the command its class (`classify_action`), each with the
    program's path, flags, redirections and numbers dropped; so `python -m pytest tests/`
    and `cd /testbed && python3 -m pytest tests/ -v 2>&1 | grep FAILED` share a key but
    `pytest tests/test_one.py` does not. The text is read as shell; a structured tool's
    text (`Read /testbed/x.py`) keys on itself.
    """
    klass = classify_action("Bash", command)
    parts: list[str] = []
    for segment in _segments(command):
        if _classify_simple(segment) != klass:
            continue
        words = _program(segment)
        kept: list[str] = []
        skip_next = False
        for index, word in enumerate(words):
            if skip_next:
                skip_next = False
                continue
            if word in _REDIRECTIONS:
                skip_next = True
                continue
            if word.startswith("-") or word.isdigit():
                continue
            if index == 0:  # /usr/bin/python3.11 -> python
                word = word.rsplit("/", 1)[-1]
                if _INTERPRETERS.match(word):
                    word = word.rstrip("0123456789.")
            kept.append(word)
        parts.append(" ".join(kept))
    return " ; ".join(parts) or " ".join(command.split())


def _segments(command: str) -> list[list[str]]:
    """Simple commands (lists of words) of a shell text; tolerant of unbalanced quotes."""
    text = _HEREDOC.sub(lambda m: " HEREDOC ;\n", command)
    text = text.replace("\\\n", " ").replace("\n", " ; ")
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: fall back to plain splitting
        tokens = re.findall(r"&&|\|\||[|;&()]|[^\s|;&()]+", text)
    segments: list[list[str]] = [[]]
    for token in tokens:
        if token in _SEPARATORS:
            segments.append([])
        else:
            segments[-1].append(token)
    return [segment for segment in segments if segment]


def _program(words: list[str]) -> list[str]:
    """Drop variable assignments and wrappers, so words[0] is the program that runs."""
    index = 0
    while index < len(words):
        word = words[index]
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word):
            index += 1
        elif word in _WRAPPERS:
            index += 1
            # timeout 60 / nice -n 5 / xargs -I{} take arguments of their own
            while index < len(words) and (
                words[index].startswith("-")
                or words[index].isdigit()
                or re.fullmatch(r"[0-9.]+[smh]?", words[index])
            ):
                index += 1
        else:
            break
    return words[index:]


def _classify_simple(words: list[str]) -> ActionClass:
    words = _program(words)
    if not words:
        return "other"
    program = words[0].rsplit("/", 1)[-1]
    args = words[1:]
    if _INTERPRETERS.match(program) and program.startswith(("python", "pypy")):
        return _classify_python(args)
    if program in _TEST_PROGRAMS or _TEST_SCRIPTS.search(words[0]):
        return "test_runner"
    if program in _INSTALLERS:
        return _classify_tool_verb(program, args)
    if program in _COMPILERS:
        if program == "make" and any(arg in {"test", "check", "tests"} for arg in args):
            return "test_runner"
        return "compiler"
    if _INTERPRETERS.match(program) or (
        program in {"bash", "sh", "zsh"} and args and not args[0].startswith("-")
    ):
        return "interpreter"
    if program in _VCS:
        return "vcs"
    if program in {"sed", "perl"} and any(arg.startswith("-i") or arg == "-pi" for arg in args):
        return "file_edit"
    if program in {"cat", "echo", "printf"} and ">" in args:
        return "file_edit"
    if program in _EDIT:
        return "file_edit"
    if program in _SEARCH:
        return "search"
    if program in _READ or program == "sed":
        return "file_read"
    return "other"


def _classify_python(args: list[str]) -> ActionClass:
    """`python -m pytest`, `python -m pip install`, `python setup.py build_ext`, `python x.py`."""
    if len(args) >= 2 and args[0] == "-m":
        module = args[1]
        if module in {"pytest", "unittest", "tox", "nose", "nox", "doctest"}:
            return "test_runner"
        if module in {"pip", "uv", "ensurepip", "venv", "virtualenv"}:
            return "package_install" if module != "pip" or _has_install(args[2:]) else "other"
        if module in {"compileall", "build", "py_compile", "cython"}:
            return "compiler"
        return "interpreter"
    script = next((arg for arg in args if not arg.startswith("-")), "")
    if script.endswith("setup.py"):
        rest = args[args.index(script) + 1 :]
        if any(verb in {"install", "develop"} for verb in rest):
            return "package_install"
        if any(verb in _BUILD_VERBS for verb in rest):
            return "compiler"
        if "test" in rest:
            return "test_runner"
    if script and _TEST_SCRIPTS.search(script.removesuffix(".py")):
        return "test_runner"
    return "interpreter"


def _has_install(args: list[str]) -> bool:
    return any(arg in _INSTALL_VERBS for arg in args[:3])


def _classify_tool_verb(program: str, args: list[str]) -> ActionClass:
    """Package managers double as test runners and builders: `npm test`, `cargo build`."""
    verbs = [arg for arg in args if not arg.startswith("-")]
    if program == "uv" and verbs[:1] == ["run"] and len(verbs) > 1:
        return _classify_simple(verbs[1:])
    verb = verbs[0] if verbs else ""
    if verb == "run" and len(verbs) > 1:
        verb = verbs[1]
    if verb in {"test", "tests"} or (
        program in {"npm", "yarn", "pnpm"} and verb.startswith("test")
    ):
        return "test_runner"
    if program == "uv" and verb == "pip":
        return "package_install" if _has_install(verbs[1:]) else "other"
    if (program == "go" and verb == "get") or verb in _INSTALL_VERBS - {"get"}:
        return "package_install"
    if verb in _BUILD_VERBS or (verb in {"check", "tsc"} and program in {"cargo", "npm", "yarn"}):
        return "compiler"
    return "other"
