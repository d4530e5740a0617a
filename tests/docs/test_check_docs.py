"""Tests of tests/docs/check_docs.py (unittest, standard library only; ctest runs it as docs.checker).

Each test writes a small tree into a temporary directory (not a git checkout: the checker walks it) and
runs the checker's main() on it, with a fake build directory whose `ferry` is a shell script (so no
build is needed): `ferry run FILE` runs FILE's lines as shell commands.

    python3 tests/docs/test_check_docs.py [-v]
"""

import contextlib
import io
import os
import shutil
import sys
import tempfile
import textwrap
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_docs  # noqa: E402

M = "<!-- ferry:run -->"

# A stand-in for the `ferry` command: `ferry run FILE` runs FILE with sh, after checking the
# environment every snippet gets.
FAKE_FERRY = """#!/bin/sh
[ "$1" = run ] || { echo "fake ferry: only run" >&2; exit 64; }
[ "$FERRY_DEVICE" = host ] || { echo "FERRY_DEVICE is '$FERRY_DEVICE'" >&2; exit 65; }
exec sh "$2"
"""


class Tree:
    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="check-docs-test-")
        build = os.path.join(self.root, "build")
        os.makedirs(os.path.join(build, "python"))
        self.write("build/ferry", FAKE_FERRY)
        os.chmod(os.path.join(build, "ferry"), 0o755)

    def write(self, rel, text):
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text))
        return rel

    def check(self, *args):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = check_docs.main(["--root", self.root, "--build", "build"] + list(args))
        return rc, out.getvalue()

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)


def fenced(lang, body, marker=M):
    return "%s\n```%s\n%s\n```\n" % (marker, lang, textwrap.dedent(body).strip("\n"))


class AnchorTest(unittest.TestCase):
    def test_troubleshooting_headings(self):
        # The headings of engine/TROUBLESHOOTING.md and the anchors the sources name.
        cases = {
            "Locked memory (ulimit -l)": "locked-memory-ulimit--l",
            "The pinned budget": "the-pinned-budget",
            "A second backward with overlap on": "a-second-backward-with-overlap-on",
            "A rank timed out or was lost": "a-rank-timed-out-or-was-lost",
            "A refused checkpoint load": "a-refused-checkpoint-load",
            "A policy error": "a-policy-error",
        }
        for heading, anchor in cases.items():
            self.assertEqual(check_docs.github_anchor(heading), anchor, heading)

    def test_github_rules(self):
        self.assertEqual(check_docs.github_anchor("Python: `ferry.torch.Optimizer` for PyTorch trainers"),
                         "python-ferrytorchoptimizer-for-pytorch-trainers")
        self.assertEqual(check_docs.github_anchor("Embedding Ferry in a C++ trainer"), "embedding-ferry-in-a-c-trainer")
        self.assertEqual(check_docs.github_anchor("snake_case and-dash"), "snake_case-and-dash")
        self.assertEqual(check_docs.github_anchor("A [link](x.md) here"), "a-link-here")

    def test_repeated_headings(self):
        page = check_docs.Page("x.md", "# Notes\n## Notes\n### Notes\n")
        self.assertEqual(page.anchors, {"notes", "notes-1", "notes-2"})


class LinkTest(unittest.TestCase):
    def setUp(self):
        self.t = Tree()
        self.t.write("docs/guide.md", """\
            # Guide
            ## Set up
            ## Set up
            text
            """)
        self.t.write("src/thing.txt", "x\n")

    def tearDown(self):
        self.t.close()

    def test_good_links(self):
        self.t.write("README.md", """\
            # Top
            ## A section
            See [the guide](docs/guide.md), [its second set-up](docs/guide.md#set-up-1),
            [a file](src/thing.txt), [a folder](src/), [here](#a-section), [web](https://example.com/x),
            [mail](mailto:a@b.c) and ![img](src/thing.txt "title").
            `[not a link](nowhere.md)` and:

            ```
            [not a link either](nowhere.md)
            ```
            [ref]: docs/guide.md#guide
            """)
        rc, out = self.t.check("--links-only")
        self.assertEqual(rc, 0, out)
        self.assertIn("7 links checked", out)

    def test_relative_to_the_file(self):
        self.t.write("docs/other.md", "[back](guide.md#set-up) [up](../src/thing.txt)\n")
        rc, out = self.t.check("--links-only")
        self.assertEqual(rc, 0, out)

    def test_broken_link(self):
        self.t.write("README.md", "# Top\n\nSee [gone](docs/gone.md).\n")
        rc, out = self.t.check("--links-only")
        self.assertEqual(rc, 1, out)
        self.assertIn("README.md:3: broken link 'docs/gone.md'", out)
        self.assertIn("1 failures", out)

    def test_missing_anchor(self):
        self.t.write("README.md", "# Top\n[x](docs/guide.md#tear-down)\n[y](#nope)\n")
        rc, out = self.t.check("--links-only")
        self.assertEqual(rc, 1, out)
        self.assertIn("README.md:2: broken link 'docs/guide.md#tear-down'", out)
        self.assertIn("README.md:3: broken link '#nope'", out)

    def test_walk_skips_build_dirs(self):
        self.t.write("build-x/notes.md", "[gone](nowhere.md)\n")
        self.t.write(".gpu/notes.md", "[gone](nowhere.md)\n")
        rc, out = self.t.check("--links-only")
        self.assertEqual(rc, 0, out)

    def test_source_anchors(self):
        self.t.write("engine/src/a.cc", '"... (see engine/TROUBLESHOOTING.md#a-policy-error)"\n')
        rc, out = self.t.check("--links-only")
        self.assertEqual(rc, 0, out)
        self.assertIn("does not exist yet", out)
        self.t.write("engine/TROUBLESHOOTING.md", "# Troubleshooting\n## A policy error\n")
        rc, out = self.t.check("--links-only")
        self.assertEqual(rc, 0, out)
        self.t.write("bindings/python/b.py", "'see engine/TROUBLESHOOTING.md#the-pinned-budget'\n")
        rc, out = self.t.check("--links-only")
        self.assertEqual(rc, 1, out)
        self.assertIn("bindings/python/b.py:1: names engine/TROUBLESHOOTING.md#the-pinned-budget", out)


class SnippetTest(unittest.TestCase):
    def setUp(self):
        self.t = Tree()

    def tearDown(self):
        self.t.close()

    def run_page(self, text, *args):
        self.t.write("README.md", text)
        return self.t.check("--snippets-only", *args)

    def test_passing_snippets(self):
        rc, out = self.run_page(
            "# Top\n\n"
            + fenced("sh", """\
                test -f README.md                     # from the repo root
                test "$OMP_NUM_THREADS" = 1 && test "$FERRY_DEVICE" = host
                case "$PATH" in "$PWD/build:"*) ;; *) exit 3;; esac
                test -d "$TMPDIR"
                """)
            + "\n" + M + "\n\n"   # one blank line between marker and fence is allowed
            + "```python\nimport os, sys\nassert os.environ['PYTHONPATH'].endswith('build/python')\n"
              "assert os.getcwd() == os.path.realpath(os.environ['TMPDIR'])\nprint('py ok')\n```\n"
            + fenced("lua", "test \"$PWD\" = \"$TMPDIR\"\necho lua ok")
            + "```sh\nexit 1  # not marked: not run\n```\n")
        self.assertEqual(rc, 0, out)
        self.assertIn("3 snippets run, 0 failures", out)

    def test_other_build_dir_and_python(self):
        # The GPU machine's layout: the build elsewhere than build/, and another interpreter.
        other = os.path.join(self.t.root, "out", "gpu")
        os.makedirs(os.path.join(other, "python"))
        self.t.write("out/gpu/ferry", FAKE_FERRY.replace("exec sh", "echo other build; exec sh"))
        os.chmod(os.path.join(other, "ferry"), 0o755)
        shutil.rmtree(os.path.join(self.t.root, "build"))
        fake_py = self.t.write("out/fakepy", "#!/bin/sh\necho \"fake python $*\"\n")
        os.chmod(os.path.join(self.t.root, fake_py), 0o755)
        self.t.write("x.lua", "echo ran x")
        self.t.write("README.md", "# Top\n\n" + fenced("sh", """\
            test -f README.md && test -f x.lua          # the root's entries, through links
            build/ferry run x.lua | grep -x "ran x"
            build/ferry run x.lua | grep -x "other build"
            test "$(/usr/bin/python3 -V)" = "fake python -V"
            echo /usr/bin/python3.11 x/usr/bin/python3 | grep -x "/usr/bin/python3.11 x/usr/bin/python3"
            touch made-here
            """))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = check_docs.main(["--root", self.t.root, "--build", other, "--snippets-only",
                                  "--python", os.path.join(self.t.root, fake_py)])
        self.assertEqual(rc, 0, out.getvalue())
        self.assertFalse(os.path.exists(os.path.join(self.t.root, "build")))
        self.assertFalse(os.path.exists(os.path.join(self.t.root, "made-here")))  # written in the view

    def test_venv_python_linked_to_the_debian_one(self):
        # A venv's python3 links to the system interpreter; /usr/bin/python3 in a block must still
        # become the venv's path (run by the link's path, it sees the venv's packages).
        debian = self.t.write("usr/bin/python3", "#!/bin/sh\necho \"$0\"\n")
        os.chmod(os.path.join(self.t.root, debian), 0o755)
        venv = os.path.join(self.t.root, "venv", "bin", "python3")
        os.makedirs(os.path.dirname(venv))
        os.symlink(os.path.join(self.t.root, debian), venv)
        self.t.write("README.md", "# Top\n\n" + fenced("sh", 'test "$(%s)" = "%s"\n' % (
            os.path.join(self.t.root, debian), venv)))
        saved = check_docs.DEBIAN_PYTHON
        check_docs.DEBIAN_PYTHON = os.path.join(self.t.root, debian)
        try:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = check_docs.main(["--root", self.t.root, "--snippets-only", "--python", venv])
        finally:
            check_docs.DEBIAN_PYTHON = saved
        self.assertEqual(rc, 0, out.getvalue())
        self.assertIn("1 snippets run, 0 failures", out.getvalue())

    def test_failing_snippets(self):
        for lang, body, expect in (("bash", "echo to stdout\nfalse\necho never", "exit 1"),
                                   ("sh", "false | cat", "exit 1"),        # pipefail
                                   ("shell", "echo $UNSET_VARIABLE_X", "exit 1"),  # nounset
                                   ("python", "print('before')\nraise SystemExit(3)", "exit 3"),
                                   ("lua", "echo from lua; exit 4", "exit 4")):
            with self.subTest(lang=lang, body=body):
                rc, out = self.run_page("# Top\nsome text\n" + fenced(lang, body))
                self.assertEqual(rc, 1, out)
                self.assertIn("FAIL README.md:4: snippet failed (%s) ```%s %s" % (expect, lang, body.split("\n")[0]), out)
                self.assertIn("1 failures", out)
        rc, out = self.run_page(fenced("python", "print('the tail')\nraise SystemExit(2)"))
        self.assertIn("| the tail", out)

    def test_timeout(self):
        rc, out = self.run_page(fenced("sh", "sleep 30", marker="<!-- ferry:run timeout=1 -->"))
        self.assertEqual(rc, 1, out)
        self.assertIn("snippet failed (timed out)", out)
        rc, out = self.run_page(fenced("sh", "sleep 30"), "--timeout", "1")
        self.assertEqual(rc, 1, out)
        self.assertIn("timed out", out)

    def test_not_runnable(self):
        for lang in ("cpp", "c", ""):
            with self.subTest(lang=lang):
                rc, out = self.run_page(fenced(lang, "int main() { return 0; }"))
                self.assertEqual(rc, 1, out)
                self.assertIn("cannot be run", out)

    def test_stray_markers(self):
        rc, out = self.run_page("# Top\n" + M + "\n\n\n```sh\ntrue\n```\n")   # two blank lines
        self.assertEqual(rc, 1, out)
        self.assertIn("README.md:2: a ferry:run marker not followed", out)
        rc, out = self.run_page("# Top\n" + M + "\ntext\n")
        self.assertEqual(rc, 1, out)
        rc, out = self.run_page("<!-- ferry:run retries=3 -->\n```sh\ntrue\n```\n")
        self.assertEqual(rc, 1, out)
        self.assertIn("bad ferry:run marker options", out)

    def test_list_and_links_only(self):
        self.t.write("README.md", "# Top\n" + fenced("sh", "exit 1") + fenced("python", "x = 1"))
        rc, out = self.t.check("--list")
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.splitlines(), ["README.md:3\tsh\texit 1", "README.md:7\tpython\tx = 1"])
        rc, out = self.t.check("--links-only")
        self.assertEqual(rc, 0, out)
        rc, out = self.t.check()
        self.assertEqual(rc, 1, out)

    def test_one_file(self):
        self.t.write("a.md", fenced("sh", "exit 1"))
        self.t.write("b.md", fenced("sh", "true"))
        rc, out = self.t.check("--file", "b.md")
        self.assertEqual(rc, 0, out)
        self.assertIn("1 files", out)
        rc, out = self.t.check("--file", "a.md")
        self.assertEqual(rc, 1, out)

    def test_skip_lang(self):
        rc, out = self.run_page(fenced("python", "raise SystemExit(1)") + fenced("sh", "true"),
                                "--skip-lang", "python")
        self.assertEqual(rc, 0, out)
        self.assertIn("1 snippets run (1 skipped)", out)

    def test_shell_block_that_needs_python(self):
        # A shell block that runs a Python sample: skipped with --skip-lang python, run without it.
        page = fenced("sh", "exit 4", marker="<!-- ferry:run needs=python -->") + fenced("sh", "true")
        rc, out = self.run_page(page, "--skip-lang", "python")
        self.assertEqual(rc, 0, out)
        self.assertIn("1 snippets run (1 skipped)", out)
        self.assertIn("needs=python", out)
        rc, out = self.run_page(page)
        self.assertEqual(rc, 1, out)
        self.assertIn("exit 4", out)
        rc, out = self.run_page(fenced("sh", "true", marker="<!-- ferry:run needs=lua -->"))
        self.assertEqual(rc, 1, out)
        self.assertIn("only timeout=SECONDS and needs=python", out)

    def test_torch_skipped_without_torch(self):
        fake = self.t.write("nopython.sh", "#!/bin/sh\ncase \"$2\" in 'import torch') exit 1;; esac\nexec %s \"$@\"\n"
                            % sys.executable)
        os.chmod(os.path.join(self.t.root, fake), 0o755)
        check_docs.can_import_torch.__defaults__[0].clear()
        rc, out = self.run_page(fenced("python", "import torch\nraise SystemExit(1)"),
                                "--python", os.path.join(self.t.root, fake))
        self.assertEqual(rc, 0, out)
        self.assertIn("skipped", out)
        self.assertIn("0 snippets run (1 skipped)", out)


if __name__ == "__main__":
    unittest.main()
