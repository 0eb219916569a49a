"""Every code block of the README and of docs/ runs, so no example can rot.

- Python blocks run, a page's blocks in order in one namespace (as a reader runs them in
  one session), in a fresh process per page with the suite's compilation cache; a page
  whose blocks need a device mesh runs with eight CPU devices.
- Shell blocks: each command is parsed by kvjax's command line (`kvjax ...` and the
  `scripts/` that wrap it); a `kvjax run` config is resolved with its `--set` overrides (an
  unknown key or value fails); every file a command names exists; other scripts must be
  executable files of the clone; `python -c` code must compile.
- TOML blocks load as experiment configs (`kvjax.lab.runner.resolve`).
- `text` blocks (layouts, outputs) are not code; a fence must name its language.
- Every relative link names a file that exists, and a heading of it that exists.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvjax import ConfigError

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
LANGUAGES = {"python", "bash", "toml", "text"}
MESH_PAGES = {"scale-out.md"}  # their Python needs eight devices
WRAPPERS = {"scripts/run": "run", "scripts/bench": "bench", "scripts/train": "train"}


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """(language, code, first line) of each fenced block of `page`."""
    text = page.read_text()
    return [(m.group(1).strip(), m.group(2), text[: m.start()].count("\n") + 1)
            for m in FENCE.finditer(text)]


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_fence_names_a_known_language():
    unnamed = [f"{_rel(p)}:{line} {lang!r}" for p in PAGES for lang, _, line in blocks(p)
               if lang not in LANGUAGES]
    assert not unnamed, unnamed
    assert sum(len(blocks(p)) for p in PAGES) >= 25  # the fence pattern finds them


def _python_pages() -> list[Path]:
    return [p for p in PAGES if any(lang == "python" for lang, _, _ in blocks(p))]


@pytest.mark.parametrize("page", _python_pages(), ids=_rel)
def test_python_blocks_run(page):
    code = "\n".join(f"# {_rel(page)}:{line}\n{body}" for lang, body, line in blocks(page)
                     if lang == "python")
    if "kvjax.models.load(" in code:  # as tests/test_real_model.py: scripts/test installs it
        from kvjax import models

        try:
            models.path("smollm2-135m-instruct")
        except models.ModelNotInstalledError as e:
            if os.environ.get("KVJAX_NO_MODELS"):
                pytest.skip(f"KVJAX_NO_MODELS is set: {e}")
            pytest.fail(f"{e} (scripts/test installs it)")
    if "kvjax.data" in code:  # the data packages, which scripts/test installs likewise
        from kvjax.data import DataNotInstalledError, sources

        try:
            for name in sources.SOURCES:
                sources.path(name)
        except DataNotInstalledError as e:
            if os.environ.get("KVJAX_NO_MODELS"):
                pytest.skip(f"KVJAX_NO_MODELS is set: {e}")
            pytest.fail(str(e))
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # the suite's compile cache: tests/conftest.py
    if page.name in MESH_PAGES:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


def commands(body: str) -> list[list[str]]:
    """The commands of a shell block: comments dropped, continuations joined, `&&` split,
    leading VAR=value assignments dropped."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            cmd, words = words[:cut], words[cut + 1:]
            while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", cmd[0]):
                cmd = cmd[1:]
            if cmd:
                out.append(cmd)
    return out


def _shell_commands() -> list[tuple[str, list[str]]]:
    return [(f"{_rel(p)}:{line}", cmd) for p in PAGES for lang, body, line in blocks(p)
            if lang == "bash" for cmd in commands(body)]


def check_command(cmd: list[str]) -> None:
    """Raises (AssertionError, SystemExit from argparse, ConfigError) when `cmd` would not
    start as written."""
    from kvjax.cli import build_parser

    head, args = cmd[0], cmd[1:]
    if head in WRAPPERS:
        head, args = "kvjax", [WRAPPERS[head], *args]
    if head == "kvjax":
        parsed = build_parser().parse_args(args)
        for arg in args:
            if arg.endswith((".toml", ".json", ".gguf")) and not arg.startswith("results"):
                assert (ROOT / arg).is_file(), f"{arg} does not exist"
        if parsed.command == "run" and parsed.config is not None:
            from kvjax.lab import runner

            runner.resolve(str(ROOT / parsed.config), parsed.set)
        return
    if head == "scripts/train_eagle":
        from kvjax.train.eagle_run import build_parser as eagle_parser

        eagle_parser().parse_args(args)
    if head == "python":
        assert args[:1] == ["-c"], f"python {args}: only `python -c CODE` is checked"
        compile(args[1], "<doc>", "exec")
        return
    path = ROOT / head
    assert path.is_file() and os.access(path, os.X_OK), f"{head} is not a script of kvjax"


@pytest.mark.parametrize(("where", "cmd"), _shell_commands(),
                         ids=[w for w, _ in _shell_commands()])
def test_shell_commands_parse(where, cmd):
    check_command(cmd)


@pytest.mark.parametrize(("cmd", "error"), [
    ("kvjax run configs/nope.toml", AssertionError),  # no such config
    ("kvjax run configs/eviction.toml --set nope=1", ConfigError),  # no such key
    ("kvjax run configs/eviction.toml --set eviction=random", ConfigError),  # a bad value
    ("kvjax bench --nope", SystemExit),  # no such option
    ("scripts/nope", AssertionError),  # no such script
    ("scripts/train_eagle --setting nope", SystemExit),  # no such setting
    ("python -c 'def'", SyntaxError),  # code that does not compile
])
def test_the_shell_check_can_fail(cmd, error):
    with pytest.raises(error):
        check_command(commands(cmd)[0])


def test_toml_blocks_load_as_experiment_configs(tmp_path):
    from kvjax.lab import runner

    found = 0
    for page in PAGES:
        for lang, body, line in blocks(page):
            if lang == "toml":
                path = tmp_path / f"{page.stem}_{line}.toml"
                path.write_text(textwrap.dedent(body))
                runner.resolve(str(path), [])
                found += 1
    assert found >= 1


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of `page`'s headings (outside code blocks)."""
    text = FENCE.sub("", page.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


def broken_links(page: Path) -> list[str]:
    """Relative links of `page` whose file or heading does not exist."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and (file.suffix != ".md"
                                             or anchor not in _anchors(file))):
            out.append(f"{page.name}: {target}")
    return out


def test_every_relative_link_resolves(tmp_path):
    assert not [b for p in PAGES for b in broken_links(p)]
    page = tmp_path / "page.md"
    page.write_text("# Title\n[ok](#title) [gone](#nothing) [file](nope.md) [far](../x.md#y)\n")
    assert [b.split(": ")[1] for b in broken_links(page)] == ["#nothing", "nope.md",
                                                               "../x.md#y"]
