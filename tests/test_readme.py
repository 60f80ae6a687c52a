"""The examples of README.md and docs/*.md, checked against the code and run against a live
server, so that they cannot drift; and every relative link between those files, checked to
resolve.

**Documents.** README.md and every docs/*.md are read the same way: the rules below hold in
each, and every message names the file and line (`docs/api.md:80: ...`).

**Blocks.** A fenced block whose info string (its first word) is python, sh, bash, shell or
console is an example; one with no info string, or one in NOT_CODE (text, json, ...), is not
code; any other info string fails `test_blocks_are_known`, so no block is passed over silently.
An example is RUN unless the last non-blank line before its opening fence is

    <!-- readme-test: skip — REASON -->

(an em or en dash, `--` or `-` before a non-empty reason). A skip without a reason, any other
`readme-test` comment, or one that no example block follows fails; each skipped block is
reported as a pytest skip with its reason. In a console block, the `$ ` lines are the commands.

**Static checks** (`test_commands_parse`, every example, run or skipped; no server, so not
marked slow): a python block compiles. In a shell block, every `clipserve ...` command (also
`.venv/bin/clipserve`, `python -m clipserve`) goes through `clipserve.cli.main` itself, so
through its own subcommand selection (`export`, `profile`) and parsers, with `parse_args`
stopped right after it succeeds; flags must be written in full (no argparse abbreviations), and
the values parsed must pass `load_config`. Every `clipserve-bench ...` (`python -m
clipserve.loadgen`) goes through `clipserve.loadgen.cli.main` the same way (`report` and
`ceiling` have their own parsers). Every `make X` names a Makefile target (with `ARGS=...`, the
ARGS are parsed by the clipserve or clipserve-bench command of X's recipe); every `python -m M`
names an importable module; every `pip install '.[E]'` names extras of pyproject.toml; every
`docker ... -f FILE` names a file of this checkout. Sample answers (below) must read as JSON.

**Running** (`test_block_runs`, marked slow: it loads the real ViT-B-32). One `clipserve
--pretrained none --port P` from the venv (what `make serve` runs: ViT-B-32 with random weights
on the CPU, here on a free port) serves the module's blocks. In a block, `127.0.0.1:8000` and
`localhost:8000` become port P; the block runs in a fresh directory holding every image it
names (`*.jpg`, `*.jpeg`, `*.png`, `*.webp`: a synthesised picture written by Pillow). Shell
blocks run under `bash -euo pipefail` with the venv's bin first on PATH and a curlrc of
`fail-with-body`, so an HTTP error fails the block like any failing command; python blocks run
with the venv's python. Each must exit 0 within BLOCK_TIMEOUT_S; a failure shows the block as
run, its output and, for a shell block, the file and line of the command that failed (a bash DEBUG
trap marks each command's start in the output, which is also how each command's own answer is
found for the sample answers).

**Sample answers.** In a shell block, a comment line `# {...}` below a command is that
command's sample answer, e.g.
`# {"embedding":[0.0123,...],"model":"ViT-B-32/random","normalized":true,"dim":512}`:

- a bare `...` (outside strings) elides array items and is dropped, with the commas it leaves:
  `[0.0123,...]` reads `[0.0123]`, `[[...],[...]]` reads `[[],[]]`; the rest must parse as a
  JSON object;
- the command's real output must be a JSON object with exactly the same top-level keys (so a
  `...` in place of top-level keys fails: name them all);
- a top-level scalar value (string, number, true, false, null) must equal the real one, unless
  it is the string `"..."`; a top-level array or object must be one in the answer too, its
  contents not compared.

**Links** (`test_relative_links_resolve`): every Markdown link or image outside code, in every
document, whose target has no scheme must name an existing file or folder relative to its
document, and a `#fragment` must be the anchor GitHub makes of a heading of the target (or of
the document itself, for `#fragment` alone).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn
from unittest import mock

import pytest

from clipserve.loadgen.images import encode, synthetic_image
from clipserve.loadgen.procs import free_port, ready, stop
from tests.helpers import until

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAKEFILE = ROOT / "Makefile"
PYPROJECT = ROOT / "pyproject.toml"
VENV_BIN = Path(sys.executable).parent  # .venv/bin: the environment running these tests

SHELL_LANGS = {"sh", "bash", "shell", "console"}
EXAMPLE_LANGS = {"python", *SHELL_LANGS}
NOT_CODE = {"", "text", "txt", "json", "yaml", "yml", "toml", "ini", "diff"}
DIRECTIVE = re.compile(r"^\s*<!--\s*readme-test:(.*?)-->\s*$")
SKIP = re.compile(r"^\s*skip\s*(?:\u2014|\u2013|--|-)\s*(\S.*?)\s*$")
IMAGE_FILE = re.compile(r"(?<![\w./-])((?:\./)?[\w][\w./-]*\.(?:jpe?g|png|webp))\b")
DEFAULT_ADDRESS = re.compile(r"\b(127\.0\.0\.1|localhost):8000\b")
GRPC_ADDRESS = re.compile(r"\b(127\.0\.0\.1|localhost):8001\b")  # gRPC, on its own free port
SAMPLE = re.compile(r"^\s*#\s*(\{.*)$")
SEPARATORS = {"|", "||", "&&", ";", "&", "|&", "(", ")"}

STARTUP_S = 240  # the real ViT-B-32 loads and warms up in ~10 s here; a loaded machine is slower
BLOCK_TIMEOUT_S = 120
MARK = "\x1e"  # a bash DEBUG trap writes MARK + the script line before each command


# ---- the documents' blocks ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Block:
    doc: str  # the document, relative to the checkout: README.md, docs/api.md
    line: int  # document line of the opening fence
    info: str  # the info string's first word, lower case
    code: str
    skip: str | None = None  # the reason, when a skip directive precedes the block
    problem: str | None = None  # a malformed directive before it

    @property
    def first(self) -> int:
        """Document line of the block's first line of code."""
        return self.line + 1

    @property
    def is_shell(self) -> bool:
        return self.info in SHELL_LANGS

    def where(self, offset: int = 0) -> str:
        return f"{self.doc}:{self.first + offset}"


def parse_document(text: str, doc: str) -> tuple[list[Block], list[str]]:
    """Every fenced block of the document `doc`, and its problems (unknown info strings, stray
    directives, an unclosed fence)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    pending: tuple[int, str] | None = None  # (line, directive text) not yet followed by a block
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)", lines[i])  # lists indent
        if fence is None:
            if match := DIRECTIVE.match(lines[i]):
                if pending is not None:
                    problems.append(f"{doc}:{pending[0]}: readme-test comment before no block")
                pending = (i + 1, match.group(1))
            elif "readme-test" in lines[i]:
                problems.append(
                    f"{doc}:{i + 1}: not a one-line '<!-- readme-test: skip — REASON -->'"
                )
            elif lines[i].strip() and pending is not None:
                problems.append(f"{doc}:{pending[0]}: readme-test comment before no block")
                pending = None
            i += 1
            continue
        indent, marks, info = len(fence.group(1)), fence.group(2), fence.group(3).lower()
        closing = re.compile(rf"^\s*{re.escape(marks[0])}{{{len(marks)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), None)
        if end is None:
            problems.append(f"{doc}:{i + 1}: unclosed fence")
            break
        code = "\n".join(
            line[indent:] if line[:indent].isspace() else line for line in lines[i + 1 : end]
        )
        skip = problem = None
        if pending is not None:
            directive = pending[1]
            if info not in EXAMPLE_LANGS:
                problems.append(
                    f"{doc}:{pending[0]}: readme-test comment before a non-example block"
                )
            elif match := SKIP.match(directive):
                skip = match.group(1)
            else:
                problem = (
                    f"{doc}:{pending[0]}: {directive.strip()!r}: expected "
                    "'<!-- readme-test: skip — REASON -->' with a non-empty reason"
                )
            pending = None
        if info not in EXAMPLE_LANGS | NOT_CODE:
            problems.append(
                f"{doc}:{i + 1}: block language {info!r} is neither an example language "
                f"({', '.join(sorted(EXAMPLE_LANGS))}) nor in NOT_CODE: say which in {__name__}"
            )
        blocks.append(Block(doc, i + 1, info, code, skip, problem))
        i = end + 1
    if pending is not None:
        problems.append(f"{doc}:{pending[0]}: readme-test comment before no block")
    return blocks, problems


def relative(path: Path) -> str:
    """`path` as messages name it: relative to the checkout where it lies inside it."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


BLOCKS: list[Block] = []
DOCUMENT_PROBLEMS: list[str] = []
for _path in DOCUMENTS:
    _blocks, _problems = parse_document(_path.read_text(encoding="utf-8"), relative(_path))
    BLOCKS += _blocks
    DOCUMENT_PROBLEMS += _problems
EXAMPLES = [b for b in BLOCKS if b.info in EXAMPLE_LANGS]
EXAMPLE_PARAMS = [pytest.param(b, id=f"{Path(b.doc).stem}-line{b.line}-{b.info}") for b in EXAMPLES]


# ---- shell commands ---------------------------------------------------------------------------


@dataclasses.dataclass
class Command:
    line: int  # document line where it starts
    end: int  # document line where it ends (backslash continuations)
    text: str
    samples: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (line, JSON)


def strip_comment(line: str) -> str:
    """`line` without its shell comment: a `#` that starts a word outside quotes."""
    quote = ""
    escaped = False
    for i, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def shell_commands(block: Block) -> list[Command]:
    """The block's command lines (continuations joined; a console block's `$ ` lines), each with
    the sample answers written below it."""
    commands: list[Command] = []
    lines = block.code.splitlines()
    i = 0
    while i < len(lines):
        start, text = i, lines[i]
        i += 1
        if block.info == "console":
            if not text.startswith("$ "):
                continue
            text = text[2:]
        if not text.strip():
            continue
        if text.lstrip().startswith("#"):
            if (sample := SAMPLE.match(text)) and commands:
                commands[-1].samples.append((block.first + start, sample.group(1)))
            elif sample:
                raise AssertionError(f"{block.where(start)}: a sample answer below no command")
            continue
        while strip_comment(text).rstrip().endswith("\\") and i < len(lines):
            text = strip_comment(text).rstrip()[:-1] + " " + lines[i]
            i += 1
        commands.append(Command(block.first + start, block.first + i - 1, text))
    return commands


def simple_commands(text: str) -> list[list[str]]:
    """`text` split into simple commands' words: no comments, separators, redirections or
    leading VAR=value assignments."""
    lexer = shlex.shlex(strip_comment(text), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    words = list(lexer)
    out: list[list[str]] = [[]]
    skip_next = False
    for word in words:
        if skip_next:
            skip_next = False
        elif word in SEPARATORS:
            out.append([])
        elif set(word) <= set("<>&"):  # a redirection: drop it, its target and its fd
            if out[-1] and out[-1][-1].isdigit():
                out[-1].pop()
            skip_next = True
        elif not out[-1] and re.match(r"^[A-Za-z_]\w*=", word):
            continue
        else:
            out[-1].append(word)
    return [words for words in out if words]


# ---- static checks ----------------------------------------------------------------------------


class Parsed(BaseException):
    """parse_args succeeded: the command stops there (BaseException: no `except Exception` in
    the command catches it)."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__()
        self.namespace = namespace


def parse_with(main: Callable[[list[str]], int], argv: list[str]) -> argparse.Namespace | None:
    """Run a command's `main(argv)` up to its parser's answer, through its own subcommand
    selection: the parsed namespace, or None for --help and --version. A parse error (an
    abbreviated flag included) raises AssertionError with argparse's message, instead of
    exiting."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        self.allow_abbrev = False  # a README names flags in full: `--round` is not `--rounds`
        raise Parsed(real(self, *args, **kwargs))

    err = io.StringIO()
    try:
        with (
            mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop),
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            main(argv)
    except Parsed as parsed:
        return parsed.namespace
    except SystemExit as e:
        if e.code in (0, None):
            return None
        message = err.getvalue().strip().splitlines()
        raise AssertionError(message[-1] if message else f"exit {e.code}") from None
    raise AssertionError("the command returned without parsing its arguments")


def check_clipserve(argv: list[str]) -> None:
    from clipserve.cli import main
    from clipserve.config import load_config

    namespace = parse_with(main, argv)
    if namespace is not None:
        try:
            load_config(vars(namespace), environ={})
        except Exception as e:
            raise AssertionError(f"parses, but load_config refuses it: {e}") from None


def check_bench(argv: list[str]) -> None:
    from clipserve.loadgen.cli import main

    parse_with(main, argv)


PROGRAMS: dict[str, Callable[[list[str]], None]] = {
    "clipserve": check_clipserve,
    "clipserve-bench": check_bench,
}
MODULES: dict[str, Callable[[list[str]], None]] = {
    "clipserve": check_clipserve,
    "clipserve.loadgen": check_bench,
}


def make_targets() -> dict[str, list[str]]:
    """The Makefile's targets, each with its recipe lines."""
    targets: dict[str, list[str]] = {}
    current: list[str] = []
    for line in MAKEFILE.read_text().splitlines():
        if line.startswith("\t"):
            for name in current:
                targets[name].append(line.strip())
            continue
        if not line.strip():
            continue
        rule = re.match(r"^([^\s:=#][^:=#]*?)\s*:(?!=)\s*(.*)$", line)
        current = []
        if rule is None:
            continue
        names = rule.group(1).split()
        for name in names:
            targets.setdefault(name, [])
        if not re.match(r"^[A-Za-z_]\w*\s*[:+?]?=", rule.group(2)):  # not a target variable
            current = names
    return targets


def check_make(argv: list[str]) -> None:
    targets = make_targets()
    variables = dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("-"))
    named = [a for a in argv if "=" not in a and not a.startswith("-")]
    if unknown := [t for t in named if t not in targets]:
        raise AssertionError(f"no such Makefile target: {', '.join(unknown)}")
    if "ARGS" not in variables:
        return
    for target in named:
        for recipe in targets[target]:
            run = re.match(r"^\$\(BIN\)/(clipserve(?:-bench)?)\s+(.*)\$\(ARGS\)", recipe)
            if run:
                PROGRAMS[run.group(1)](shlex.split(run.group(2)) + shlex.split(variables["ARGS"]))


def check_module(argv: list[str]) -> None:
    if "-m" not in argv or argv.index("-m") + 1 >= len(argv):
        return
    at = argv.index("-m")
    module, rest = argv[at + 1], argv[at + 2 :]
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise AssertionError(f"no module {module}")
    if spec.submodule_search_locations is not None and not importlib.util.find_spec(
        module + ".__main__"
    ):
        raise AssertionError(f"package {module} has no __main__: `python -m {module}` fails")
    if module == "pip":
        check_pip(rest)
    elif module in MODULES:
        MODULES[module](rest)


def check_pip(argv: list[str]) -> None:
    extras = set(tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"])
    for arg in argv:
        match = re.match(r"^(?:\.|clipserve)\[([^\]]*)\]$", arg)
        if match and (unknown := {e.strip() for e in match.group(1).split(",")} - extras):
            raise AssertionError(f"pyproject.toml has no extra {', '.join(sorted(unknown))}")


def check_docker(argv: list[str]) -> None:
    for flag, value in itertools.pairwise(argv):
        if flag in ("-f", "--file") and not (ROOT / value).is_file():
            raise AssertionError(f"{value}: no such file in the checkout")


def check_command(words: list[str]) -> None:
    program, args = Path(words[0]).name, words[1:]
    if program in PROGRAMS:
        PROGRAMS[program](args)
    elif program == "make":
        check_make(args)
    elif re.fullmatch(r"python(3(\.\d+)?)?", program):
        check_module(args)
    elif program in ("pip", "pip3"):
        check_pip(args[1:] if args[:1] == ["install"] else [])
    elif program == "docker":
        check_docker(args)


def static_problems(block: Block) -> list[str]:
    if not block.is_shell:
        try:
            compile(block.code, block.where(), "exec")
        except SyntaxError as e:
            return [f"{block.doc}:{block.line + (e.lineno or 1)}: does not compile: {e.msg}"]
        return []
    problems = []
    for command in shell_commands(block):
        for words in simple_commands(command.text):
            try:
                check_command(words)
            except AssertionError as e:
                problems.append(f"{block.doc}:{command.line}: `{shlex.join(words)}`: {e}")
        for line, sample in command.samples:
            try:
                read_sample(sample)
            except AssertionError as e:
                problems.append(f"{block.doc}:{line}: {e}")
    return problems


# ---- sample answers ---------------------------------------------------------------------------

STRING = r'("(?:\\.|[^"\\])*")'


def read_sample(text: str) -> dict[str, Any]:
    """A sample answer, its elisions dropped (see the module's docstring)."""

    def outside_strings(pattern: str, replace: str, s: str) -> str:
        return re.sub(STRING + "|" + pattern, lambda m: m.group(1) or m.expand(replace), s)

    kept = outside_strings(r"\.\.\.", "", text)
    while True:  # the commas an elision leaves: "[0.1,]", "[,0.1]", "[0.1,,0.2]"
        cleaned = outside_strings(r",\s*([\]}])", r"\2", kept)
        cleaned = outside_strings(r"([\[{])\s*,", r"\2", cleaned)
        cleaned = outside_strings(r",\s*,", ",", cleaned)
        if cleaned == kept:
            break
        kept = cleaned
    try:
        sample = json.loads(kept)
    except json.JSONDecodeError as e:
        raise AssertionError(f"sample answer {text!r} does not read as JSON ({e})") from None
    if not isinstance(sample, dict):
        raise AssertionError(f"sample answer {text!r} is not a JSON object")
    return sample


def compare_answer(sample_text: str, output: str) -> str | None:
    """None when `output` matches the sample answer, else what differs."""
    sample = read_sample(sample_text)
    try:
        real = json.loads(output)
    except json.JSONDecodeError:
        return f"the answer is not JSON: {output[:300]!r}"
    if not isinstance(real, dict):
        return f"the answer is not a JSON object: {output[:300]!r}"
    if set(sample) != set(real):
        return (
            f"keys differ: the sample has {sorted(sample)}, the answer {sorted(real)} "
            f"(answer: {output[:300]})"
        )
    for key, want in sample.items():
        got = real[key]
        if isinstance(want, list | dict):
            if not isinstance(got, type(want)):
                return f"{key!r}: the sample has a {type(want).__name__}, the answer {got!r}"
        elif want != "..." and (want != got or isinstance(want, bool) != isinstance(got, bool)):
            return f"{key!r}: the sample says {want!r}, the answer {got!r}"
    return None


# ---- running blocks ---------------------------------------------------------------------------


GRPC_PORT = free_port()  # the live server's gRPC port (127.0.0.1:8001 in a block)


@pytest.fixture(scope="module")
def live_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """`clipserve --pretrained none` (as `make serve` runs it) on a free port, until the module
    ends; its port once /readyz answers 200."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("readme-server") / "clipserve.log"
    cmd = [str(VENV_BIN / "clipserve"), "--pretrained", "none", "--port", str(port)]
    cmd += ["--grpc-port", str(GRPC_PORT)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
        try:
            try:
                until(
                    lambda: proc.poll() is not None or ready(url),
                    STARTUP_S,
                    f"`{shlex.join(cmd)}` ready",
                    poll_s=0.25,
                )
            except AssertionError as e:
                pytest.fail(f"{e}\n{log_path.read_text()[-3000:]}")
            if proc.poll() is not None:
                pytest.fail(
                    f"`{shlex.join(cmd)}` exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            yield port
        finally:
            stop(proc)


def write_images(block_code: str, directory: Path) -> None:
    """Every image file the block names, as a synthesised picture in that file's format."""
    formats = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".webp": "WEBP"}
    for seed, name in enumerate(sorted(set(IMAGE_FILE.findall(block_code)))):
        path = directory / name
        if ".." in Path(name).parts or path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode(synthetic_image(320, 240, seed), formats[path.suffix.lower()]))


def environment(directory: Path) -> dict[str, str]:
    curl_home = directory / ".curl"
    curl_home.mkdir()
    (curl_home / ".curlrc").write_text("fail-with-body\nsilent\nshow-error\n")
    return {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "CURL_HOME": str(curl_home),
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "HF_HUB_OFFLINE": "1",
    }


def run_bounded(
    cmd: Sequence[str], cwd: Path, env: dict[str, str], what: str
) -> tuple[int, str, str]:
    """Run `cmd` to its end within BLOCK_TIMEOUT_S; past that, its whole process group is
    killed and the test fails."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what}\nnot done within {BLOCK_TIMEOUT_S} s\n{report(out, err)}")
    return proc.returncode, out, err


def report(out: str, err: str) -> str:
    shown = re.sub(rf"\n?{MARK}\d+\n", "", out)
    return f"--- stdout ---\n{shown[-4000:]}\n--- stderr ---\n{err[-4000:]}"


def outputs_by_line(out: str, first: int) -> list[tuple[int, str]]:
    """(document line, output) of each command, from the DEBUG trap's marks; script line 2 is the
    block's first line."""
    parts = re.split(rf"\n{MARK}(\d+)\n", "\n" + out)
    return [(first + int(parts[i]) - 2, parts[i + 1]) for i in range(1, len(parts) - 1, 2)]


# ---- links ------------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
CODE_SPAN = re.compile(r"(`+).+?\1")
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the document outside fenced blocks."""
    fence = ""
    for number, line in enumerate(text.splitlines(), 1):
        if match := FENCE.match(line):
            marks = match.group(1)
            if not fence:
                fence = marks
            elif (
                marks[0] == fence[0] and len(marks) >= len(fence) and not line.strip(marks[0] + " ")
            ):
                fence = ""
            continue
        if not fence:
            yield number, line


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped,
    spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose_lines(text):
        if match := HEADING.match(line):
            base = slug(match.group(2))
            found.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
    return found


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of every inline link and image outside code."""
    for number, line in prose_lines(text):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, match.group(1)


def link_problem(doc: Path, target: str) -> str | None:
    """None when a relative link from `doc` resolves, else why not; links with a scheme (https:,
    mailto:) are not checked."""
    if SCHEME.match(target) or target.startswith("//"):
        return None
    path, _, fragment = target.partition("#")
    file = (doc.parent / path).resolve() if path else doc
    if not file.exists():
        return f"{path}: no such file or folder"
    if not fragment:
        return None
    if file.suffix != ".md":
        return f"#{fragment}: {relative(file)} is not Markdown, so it has no headings"
    if fragment not in anchors(file.read_text(encoding="utf-8")):
        return f"#{fragment}: no such heading in {relative(file)}"
    return None


# ---- the tests --------------------------------------------------------------------------------


def test_blocks_are_known() -> None:
    """Every block is an example or declared not code, every directive is well-formed and
    precedes an example, and there is something to run."""
    problems = DOCUMENT_PROBLEMS + [b.problem for b in BLOCKS if b.problem]
    assert not problems, "\n".join(problems)
    assert any(b.skip is None for b in EXAMPLES if b.doc == "README.md"), (
        "README.md: no example is run"
    )


@pytest.mark.parametrize("block", EXAMPLE_PARAMS)
def test_commands_parse(block: Block) -> None:
    """Flags, subcommands, make targets, modules, extras and files named by the example exist,
    whether or not it runs."""
    problems = static_problems(block)
    assert not problems, "\n".join(problems) + f"\n--- block ---\n{block.code}"


@pytest.mark.slow
@pytest.mark.parametrize("block", EXAMPLE_PARAMS)
def test_block_runs(block: Block, live_port: int, tmp_path: Path) -> None:
    """The example, as written but for the port, exits 0 against `make serve`'s server, and its
    shell commands answer what their sample answers say."""
    if block.problem:
        pytest.fail(block.problem)
    if block.skip is not None:
        pytest.skip(f"{block.doc}:{block.line}: {block.skip}")
    code = DEFAULT_ADDRESS.sub(rf"\1:{live_port}", block.code)
    code = GRPC_ADDRESS.sub(rf"\1:{GRPC_PORT}", code)
    write_images(code, tmp_path)
    env = environment(tmp_path)
    if block.is_shell:
        if block.info == "console":
            code = "\n".join(
                line[2:] if line.startswith("$ ") else "" for line in code.splitlines()
            )
        trace = f'trap \'printf "\\n{MARK}%s\\n" "$LINENO"\' DEBUG'
        cmd = ["bash", "-euo", "pipefail", "-c", trace + "\n" + code]
    else:
        script = tmp_path / f"{Path(block.doc).stem}_line{block.line}.py"
        script.write_text(code)
        cmd = [str(VENV_BIN / "python"), str(script)]
    what = f"{block.doc}:{block.line} ({block.info} block) as run:\n{code}"
    rc, out, err = run_bounded(cmd, tmp_path, env, what)
    outputs = outputs_by_line(out, block.first) if block.is_shell else []
    at = f" at {block.doc}:{outputs[-1][0]}" if outputs else ""
    assert rc == 0, f"{what}\nexit status {rc}{at}\n{report(out, err)}"
    mismatches = []
    for command in shell_commands(block):
        answer = "".join(o for line, o in outputs if command.line <= line <= command.end)
        for line, sample in command.samples:
            if diff := compare_answer(sample, answer.strip()):
                mismatches.append(
                    f"{block.doc}:{line}: sample answer of line {command.line}: {diff}"
                )
    assert not mismatches, "\n".join(mismatches)


def test_relative_links_resolve() -> None:
    """Every relative link of README.md and docs/*.md names a file that exists and, with a
    #fragment, a heading of it."""
    problems = [
        f"{relative(doc)}:{line}: ({target}) {problem}"
        for doc in DOCUMENTS
        for line, target in links(doc.read_text(encoding="utf-8"))
        if (problem := link_problem(doc, target))
    ]
    assert not problems, "\n".join(problems)
    assert sum(1 for doc in DOCUMENTS for _ in links(doc.read_text(encoding="utf-8"))) > 50


def test_the_link_checker_catches_broken_links(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Intro\n## `--workers N`: faults\n## Intro\n```\n## Not a heading\n[x](#y)\n```\n"
        "See [a](#intro-1), [b](#--workers-n-faults), [c](missing.md), [d](#nope), "
        "[e](doc.md#not-a-heading), `[f](gone.md)`, [g](https://example.org/x#y).\n"
    )
    found = {
        target: link_problem(doc, target) for _, target in links(doc.read_text(encoding="utf-8"))
    }
    assert found == {
        "#intro-1": None,
        "#--workers-n-faults": None,
        "missing.md": "missing.md: no such file or folder",
        "#nope": f"#nope: no such heading in {relative(doc)}",
        "doc.md#not-a-heading": f"#not-a-heading: no such heading in {relative(doc)}",
        "https://example.org/x#y": None,
    }
