#!/usr/bin/env python3
"""Docs that cannot rot: checks the links of every Markdown file and runs its marked snippets.

Run from anywhere (Python 3.7+, standard library only):

    python3 tests/docs/check_docs.py                    # links, source anchors and snippets
    python3 tests/docs/check_docs.py --links-only       # links and source anchors (fast)
    python3 tests/docs/check_docs.py --snippets-only --build build
    python3 tests/docs/check_docs.py --list             # the runnable snippets, one per line
    python3 tests/docs/check_docs.py --file README.md   # one file (repeatable)

ctest runs it as `docs.links` (always) and `docs.snippets` (with the `ferry` command and, where the
Python tests are registered, the Python package); `docs.checker` tests this file
(tests/docs/test_check_docs.py).

The files: every tracked `*.md` (`git ls-files`), or, outside a git checkout, every `*.md` under the
root except in build*/, .git/ and .gpu/.

Links. Every relative link `[text](path)`, `[text](path#anchor)`, image `![alt](path)` and reference
definition `[id]: path` must name an existing file or directory, relative to the Markdown file (a
path starting with `/`: relative to the repository root). An anchor on a Markdown target (or a bare
`#anchor`, meaning the same page) must be a heading's GitHub anchor there: the heading's text with
inline code, links and HTML tags reduced to their text, lowercased, every character other than a
letter, digit, space, '-' or '_' dropped, spaces turned into '-'; a repeated heading gets -1, -2, ...
(`<a name="x">` / `id="x"` anchors count too). Only ATX headings (`# ...`) are read. Links with a
scheme (http:, https:, mailto:, ...) are not checked; links inside fenced code blocks and inline code
are not links.

Source anchors. Every `engine/TROUBLESHOOTING.md#anchor` written in the sources under engine/ and
bindings/ (*.cc, *.h, *.cu, *.c, *.py, *.lua) must be a heading of engine/TROUBLESHOOTING.md: the
errors a user can meet name the guide's section. Skipped, with a message, while that file is absent.

Runnable snippets. A fenced code block whose opening fence follows the line

    <!-- ferry:run -->                 or   <!-- ferry:run timeout=300 -->   or   <!-- ferry:run needs=python -->

directly or after one blank line (no more: a marker must visibly belong to its block) is run:

    sh, bash, shell   `bash -euo pipefail FILE`, from the repository root (build/ferry, samples/...).
                      The docs name the build directory `build/` and Debian's interpreter
                      `/usr/bin/python3`: with another --build (the GPU machine's build-gpu) the
                      block runs in a fresh directory of links to the root's entries, its `build`
                      the --build directory; with another --python (a venv's link to it counts
                      as another), `/usr/bin/python3` in the block is that interpreter
    python            the interpreter given by --python (default: the one running this script), in a
                      fresh temporary directory; a block that imports torch is skipped, with a
                      message, when that interpreter cannot import torch
    lua               `<build>/ferry run FILE` (the file in a fresh temporary directory), from the repo root

`--skip-lang LANG` skips a language's blocks with a message (ctest: python, when the build has no
Python package), and a shell block marked `needs=python` (one that runs a Python sample) with
`--skip-lang python`. Any other language (cpp, c, a bare fence, ...) is an error when marked, as is a marker followed by no
fence. Every snippet runs with FERRY_DEVICE=host, PYTHONPATH=<build>/python, PATH=<build>:$PATH,
OMP_NUM_THREADS=1, TMPDIR a fresh temporary directory (removed afterwards), and a timeout (default
120 s; `timeout=N` on the marker overrides it). CI has 2 cores and minutes for everything: keep marked
snippets to what a reader would paste, and small. A failure is reported with file:line, the snippet's
first line, its exit status and the tail of its output; the exit status is 1 when anything failed.
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse

MARKER_RE = re.compile(r"^\s*<!--\s*ferry:run((?:\s+[A-Za-z_]+=\S+)*)\s*-->\s*$")
FENCE_RE = re.compile(r"^( {0,3}|\s*)(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")
HEADING_RE = re.compile(r"^ {0,3}(#{1,6})(?:\s+(.*?))?\s*$")
HTML_ANCHOR_RE = re.compile(r"""<a\s[^>]*?(?:name|id)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
# [text](target "title"): the target may hold one level of balanced parentheses.
LINK_RE = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^>]*>|(?:[^()\s]|\([^()\s]*\))*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFDEF_RE = re.compile(r"^ {0,3}\[([^\]]+)\]:\s+(<[^>]*>|\S+)")
SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
SOURCE_ANCHOR_RE = re.compile(r"engine/TROUBLESHOOTING\.md#([A-Za-z0-9_-]+)")
SOURCE_EXTS = (".cc", ".h", ".cu", ".c", ".py", ".lua")
TROUBLESHOOTING = "engine/TROUBLESHOOTING.md"

SHELL_LANGS = ("sh", "bash", "shell")
DEFAULT_TIMEOUT = 120
TAIL_LINES = 25


# ---- Markdown ---------------------------------------------------------------------------------------

def heading_text(raw):
    """A heading's visible text: links to their text, inline code and HTML tags to their contents."""
    text = re.sub(r"\s+#+\s*$", "", raw)                       # closing #s
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)      # [t](u) -> t
    text = re.sub(r"<[^>]+>", "", text)                         # HTML tags
    return text.replace("`", "")


def github_anchor(heading):
    """GitHub's anchor of a heading (without the -N suffix of repeats)."""
    text = heading_text(heading).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def strip_inline_code(line):
    """The line with every inline code span blanked (same length), so no link is found inside one."""
    out, i = [], 0
    while i < len(line):
        if line[i] == "`":
            j = i
            while j < len(line) and line[j] == "`":
                j += 1
            ticks = line[i:j]
            end = line.find(ticks, j)
            while end != -1 and end + len(ticks) < len(line) and line[end + len(ticks)] == "`":
                end = line.find(ticks, end + len(ticks) + 1)
            if end == -1:
                out.append(line[i:j])
                i = j
                continue
            out.append(" " * (end + len(ticks) - i))
            i = end + len(ticks)
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


class Block:
    """A fenced code block: where it opens (1-based), its language, its text, its marker if any."""

    def __init__(self, line, lang, text, marker=None, marker_line=None):
        self.line, self.lang, self.text = line, lang, text
        self.marker, self.marker_line = marker, marker_line

    def first_line(self):
        for l in self.text.splitlines():
            if l.strip():
                return l.strip()
        return "(empty)"


class Page:
    """A parsed Markdown file: its anchors, its links (line, target) and its code blocks."""

    def __init__(self, path, text):
        self.path = path
        self.anchors = set()
        self.links = []       # (line, target)
        self.blocks = []      # Block
        self.errors = []      # (line, message): markers that mark nothing, bad marker options
        self._parse(text.splitlines())

    def _parse(self, lines):
        seen = {}
        pending = None        # (marker line, options) of a marker waiting for its fence
        blank_since = 0
        fence = None          # (char, length, indent, lang, start line, body lines, marker)
        in_comment = False
        for n, line in enumerate(lines, 1):
            if fence is not None:
                stripped = line.strip()
                char, length, indent, lang, start, body, marker = fence
                if stripped and set(stripped) == {char} and len(stripped) >= length:
                    text = "\n".join(l[min(indent, len(l) - len(l.lstrip(" "))):] for l in body)
                    self.blocks.append(Block(start, lang, text + ("\n" if body else ""),
                                             marker and marker[1], marker and marker[0]))
                    fence = None
                else:
                    body.append(line)
                continue
            m = FENCE_RE.match(line)
            if m and not in_comment:
                marker = None
                if pending is not None:
                    marker, pending = pending, None
                fence = (m.group(2)[0], len(m.group(2)), len(m.group(1).expandtabs()),
                         m.group(3).lower(), n, [], marker)
                continue
            if pending is not None:
                if line.strip() == "" and blank_since == 0:
                    blank_since = n
                else:
                    self.errors.append((pending[0], "a ferry:run marker not followed by a fenced code block "
                                                    "(at most one blank line between them)"))
                    pending = None
            mk = MARKER_RE.match(line)
            if mk:
                options = {}
                for opt in mk.group(1).split():
                    key, _, value = opt.partition("=")
                    options[key] = value
                bad = [k for k in options if k not in ("timeout", "needs")]
                if (bad or ("timeout" in options and not re.match(r"^\d+(\.\d+)?$", options["timeout"]))
                        or options.get("needs", "python") != "python"):
                    self.errors.append((n, "bad ferry:run marker options %r (only timeout=SECONDS and needs=python)"
                                        % mk.group(1).strip()))
                pending, blank_since = (n, options), 0
                continue
            # HTML comments (other than markers) hold no links.
            scan = line
            if in_comment:
                end = scan.find("-->")
                if end == -1:
                    continue
                scan, in_comment = scan[end + 3:], False
            while "<!--" in scan:
                start = scan.find("<!--")
                end = scan.find("-->", start + 4)
                if end == -1:
                    scan, in_comment = scan[:start], True
                    break
                scan = scan[:start] + scan[end + 3:]
            h = HEADING_RE.match(scan)
            if h and h.group(2) is not None:
                base = github_anchor(h.group(2))
                count = seen.get(base, 0)
                seen[base] = count + 1
                self.anchors.add(base if count == 0 else "%s-%d" % (base, count))
            for a in HTML_ANCHOR_RE.finditer(scan):
                self.anchors.add(a.group(1))
            code_free = strip_inline_code(scan)
            for lm in LINK_RE.finditer(code_free):
                self.links.append((n, lm.group(2)))
            rd = REFDEF_RE.match(code_free)
            if rd:
                self.links.append((n, rd.group(2)))
        if pending is not None:
            self.errors.append((pending[0], "a ferry:run marker not followed by a fenced code block"))
        if fence is not None:
            self.errors.append((fence[4], "a fenced code block that never closes"))


# ---- the checks -------------------------------------------------------------------------------------

def markdown_files(root):
    """Every tracked *.md (git ls-files), or every *.md of a walk outside build*/, .git/, .gpu/."""
    try:
        top = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, universal_newlines=True, check=True).stdout.strip()
        if os.path.realpath(top) == os.path.realpath(root):
            out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--", "*.md"], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, universal_newlines=True, check=True).stdout
            return sorted(f for f in out.split("\0") if f and os.path.isfile(os.path.join(root, f)))
    except (OSError, subprocess.CalledProcessError):
        pass
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(d for d in dirnames if not (d.startswith("build") or d in (".git", ".gpu")))
        found += [os.path.normpath(os.path.join(rel, f)) for f in filenames if f.endswith(".md")]
    return sorted(found)


def source_files(root):
    """The sources whose troubleshooting anchors are checked: under engine/ and bindings/."""
    files = []
    for top in ("engine", "bindings"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(SOURCE_EXTS)]
    return files


class Checker:
    def __init__(self, root):
        self.root = os.path.abspath(root)
        self.pages = {}
        self.failures = []    # text blocks
        self.links_checked = 0

    def page(self, rel):
        rel = os.path.normpath(rel)
        if rel not in self.pages:
            path = os.path.join(self.root, rel)
            with open(path, encoding="utf-8", errors="replace") as f:
                self.pages[rel] = Page(rel, f.read())
        return self.pages[rel]

    def fail(self, where, message):
        self.failures.append("%s: %s" % (where, message))

    def check_structure(self, rel):
        for line, message in self.page(rel).errors:
            self.fail("%s:%d" % (rel, line), message)

    def check_links(self, rel):
        page = self.page(rel)
        for line, target in page.links:
            where = "%s:%d" % (rel, line)
            target = target.strip()
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1].strip()
            if not target or SCHEME_RE.match(target) or target.startswith("//"):
                continue
            self.links_checked += 1
            path, _, anchor = target.partition("#")
            path = urllib.parse.unquote(path.split("?", 1)[0])
            anchor = urllib.parse.unquote(anchor)
            if not path:
                dest = rel
            elif path.startswith("/"):
                dest = os.path.normpath(path.lstrip("/"))
            else:
                dest = os.path.normpath(os.path.join(os.path.dirname(rel), path))
            full = os.path.join(self.root, dest)
            if dest.startswith(".." + os.sep) or dest == ".." or not os.path.exists(full):
                self.fail(where, "broken link %r: %s does not exist" % (target, dest))
                continue
            if anchor and dest.endswith(".md") and os.path.isfile(full):
                if anchor not in self.page(dest).anchors:
                    self.fail(where, "broken link %r: %s has no heading with anchor #%s"
                              % (target, dest, anchor))

    def check_source_anchors(self):
        """engine/TROUBLESHOOTING.md#anchor in the sources: each must be a heading there."""
        guide = os.path.join(self.root, TROUBLESHOOTING)
        uses = []
        for path in source_files(self.root):
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    for n, line in enumerate(f, 1):
                        for m in SOURCE_ANCHOR_RE.finditer(line):
                            uses.append((os.path.relpath(path, self.root), n, m.group(1)))
            except OSError:
                continue
        if not os.path.isfile(guide):
            if uses:
                print("check_docs: %s does not exist yet: %d source reference(s) to its sections not checked"
                      % (TROUBLESHOOTING, len(uses)))
            return 0
        anchors = self.page(TROUBLESHOOTING).anchors
        for rel, n, anchor in uses:
            if anchor not in anchors:
                self.fail("%s:%d" % (rel, n), "names %s#%s, which is no heading there" % (TROUBLESHOOTING, anchor))
        return len(uses)


# ---- snippets ---------------------------------------------------------------------------------------

def can_import_torch(python, cache={}):
    if python not in cache:
        try:
            cache[python] = subprocess.run([python, "-c", "import torch"], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL, timeout=120).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            cache[python] = False
    return cache[python]


def imports_torch(text):
    return re.search(r"^\s*(import\s+torch\b|from\s+torch\b)", text, re.MULTILINE) is not None


def tail(text, lines=TAIL_LINES):
    parts = text.rstrip("\n").splitlines()
    shown = parts[-lines:]
    head = ["    ... (%d lines before)" % (len(parts) - lines)] if len(parts) > lines else []
    return "\n".join(head + ["    | " + l for l in shown])


DEBIAN_PYTHON = "/usr/bin/python3"


def shell_root(root, build, tmp):
    """Where shell blocks run: the root itself when `build` is its build/, else a directory in `tmp`
    of links to the root's entries whose `build` is `build` (the docs' `build/ferry` is this build's)."""
    if os.path.realpath(build) == os.path.realpath(os.path.join(root, "build")):
        return root
    view = os.path.join(tmp, "root")
    os.mkdir(view)
    for name in os.listdir(root):
        if name != "build":
            os.symlink(os.path.join(root, name), os.path.join(view, name))
    os.symlink(os.path.abspath(build), os.path.join(view, "build"))
    return view


def run_snippet(block, root, build, python, default_timeout):
    """Runs one marked block: (status, output) with status an int exit code, 'timeout' or 'skipped: why'."""
    lang = block.lang
    timeout = float(block.marker.get("timeout", default_timeout))
    tmp = tempfile.mkdtemp(prefix="ferry-doc-")
    try:
        env = dict(os.environ)
        env.update({"FERRY_DEVICE": "host", "PYTHONPATH": os.path.join(build, "python"),
                    "PATH": build + os.pathsep + env.get("PATH", ""), "OMP_NUM_THREADS": "1",
                    "TMPDIR": tmp, "TMP": tmp, "TEMP": tmp})
        text = block.text
        if lang in SHELL_LANGS:
            script = os.path.join(tmp, "snippet.sh")
            argv, cwd = ["bash", "-euo", "pipefail", script], shell_root(root, build, tmp)
            # The paths as given, not resolved: a venv's python3 is a link to the system's, but run
            # by its own path it sees the venv's packages, and by /usr/bin/python3 it does not.
            if os.path.abspath(python) != DEBIAN_PYTHON:
                text = re.sub(r"(?<![\w/.])%s(?![\w.])" % re.escape(DEBIAN_PYTHON), python, text)
        elif lang == "python":
            if imports_torch(block.text) and not can_import_torch(python):
                return "skipped: %s cannot import torch" % python, ""
            script = os.path.join(tmp, "snippet.py")
            argv, cwd = [python, script], tmp
        elif lang == "lua":
            ferry = os.path.join(build, "ferry")
            if not os.access(ferry, os.X_OK):
                return 127, "no ferry command at %s (build it, or pass --build DIR)" % ferry
            script = os.path.join(tmp, "snippet.lua")
            argv, cwd = [ferry, "run", script], root  # as `ferry run` from the repository root
        else:
            return 2, "a ```%s block cannot be run: mark only sh/bash/shell, python or lua blocks" % (lang or "")
        with open(script, "w", encoding="utf-8") as f:
            f.write(text)
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            status = proc.returncode
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            out, _ = proc.communicate()
            status = "timeout"
            out = (out or b"") + ("\n(killed after %g s; a longer one: <!-- ferry:run timeout=N -->)" % timeout).encode()
        return status, (out or b"").decode("utf-8", errors="replace")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- main -------------------------------------------------------------------------------------------

def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="The conventions: this file's docstring.")
    ap.add_argument("--root", default=os.path.normpath(os.path.join(here, "..", "..")),
                    help="the repository root (default: the one holding this script)")
    ap.add_argument("--build", default="build", help="the build directory, relative to the root or absolute "
                                                     "(default build): its ferry and python/")
    ap.add_argument("--python", default=sys.executable, help="the interpreter of python snippets")
    ap.add_argument("--file", action="append", default=[], help="check only this Markdown file (repeatable)")
    ap.add_argument("--skip-lang", action="append", default=[], metavar="LANG",
                    help="skip the marked blocks of this language, with a message (repeatable; ctest "
                         "passes python when the build has no Python package)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per snippet (default 120)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--links-only", action="store_true", help="links and source anchors, no snippets")
    mode.add_argument("--snippets-only", action="store_true", help="snippets, no links")
    mode.add_argument("--list", action="store_true", help="list the runnable snippets and exit")
    args = ap.parse_args(argv)

    root = os.path.abspath(args.root)
    build = os.path.abspath(os.path.join(root, args.build))
    checker = Checker(root)
    if args.file:
        files = []
        for f in args.file:
            full = os.path.abspath(f) if os.path.exists(f) else os.path.join(root, f)
            files.append(os.path.relpath(full, root))
    else:
        files = markdown_files(root)

    blocks = []
    for rel in files:
        try:
            page = checker.page(rel)
        except OSError as e:
            checker.fail(rel, "cannot read: %s" % e)
            continue
        blocks += [(rel, b) for b in page.blocks if b.marker is not None]

    if args.list:
        for rel, b in blocks:
            print("%s:%d\t%s\t%s" % (rel, b.line, b.lang or "(none)", b.first_line()))
        return 0

    for rel in files:
        if rel in checker.pages:
            checker.check_structure(rel)
    anchors_used = 0
    if not args.snippets_only:
        for rel in files:
            if rel in checker.pages:
                checker.check_links(rel)
        if not args.file:
            anchors_used = checker.check_source_anchors()

    ran = skipped = 0
    if not args.links_only:
        for rel, b in blocks:
            where = "%s:%d" % (rel, b.line)
            start = time.monotonic()
            if b.lang in args.skip_lang:
                status, out = "skipped: --skip-lang %s" % b.lang, ""
            elif b.marker.get("needs") in args.skip_lang:
                status, out = "skipped: --skip-lang %s (the block needs=%s)" % ((b.marker["needs"],) * 2), ""
            else:
                status, out = run_snippet(b, root, build, args.python, args.timeout)
            took = time.monotonic() - start
            if isinstance(status, str) and status.startswith("skipped"):
                skipped += 1
                print("%s: %s (```%s %s)" % (where, status, b.lang, b.first_line()))
                continue
            ran += 1
            if status == 0:
                print("%s: ok in %.1f s (```%s %s)" % (where, took, b.lang, b.first_line()))
            else:
                checker.fail(where, "snippet failed (%s) ```%s %s\n%s"
                             % ("timed out" if status == "timeout" else "exit %s" % status,
                                b.lang, b.first_line(), tail(out)))

    for f in checker.failures:
        print("FAIL " + f)
    print("check_docs: %d files, %d links checked%s, %d snippets run%s, %d failures"
          % (len(files), checker.links_checked,
             (", %d source anchors" % anchors_used) if anchors_used else "",
             ran, (" (%d skipped)" % skipped) if skipped else "", len(checker.failures)))
    return 1 if checker.failures else 0


if __name__ == "__main__":
    sys.exit(main())
