"""install.pip: `pip install --no-build-isolation` of the source tree into a fresh venv, as a user
would, then the installed package used from outside the source tree.

    python3 pip_install.py SOURCE_DIR BUILD_DIR WORK_DIR VERSION

The venv is `python3 -m venv --system-site-packages --without-pip`: torch, setuptools and pip are
Debian's, seen through the system site packages (pip installs into the venv, whose prefix is its
own). Run from a venv's interpreter (sys.prefix != sys.base_prefix: the GPU machines, torch in that
venv), the new venv would see only the base interpreter's site packages, so a .pth file in it adds the
outer venv's (after its own: the package installed into the new venv comes first). pip runs offline (--no-index) and builds through setup.py with FERRY_CMAKE_BUILD_DIR=BUILD_DIR,
the tree CI already built: no configure, only its up-to-date target ferry_python, so the engine is
not compiled again. setuptools writes its build/ and egg-info under WORK_DIR (FERRY_PIP_BUILD_BASE);
the check fails if the install leaves anything of its own in the source tree. Then, from WORK_DIR,
with PYTHONPATH and FERRY_POLICY_DIR unset: `python -m ferry --version` prints VERSION, and
python_package.py trains one offloaded step with the policies shipped inside the installed package.
"""
import os
import shutil
import subprocess
import sys

def run(cmd, **kw):
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def litter(source):
    """What a setuptools/pip build writes into a source tree: *.egg-info at the top or beside the
    package, dist/, and build/pip, build/lib, build/lib.*, build/bdist.*, build/temp.* (build/ itself
    may be CMake's tree, where other tests write: only these names count)."""
    found = set()
    for d in (source, os.path.join(source, "bindings", "python")):
        if os.path.isdir(d):
            found.update(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".egg-info"))
    if os.path.isdir(os.path.join(source, "dist")):
        found.add(os.path.join(source, "dist"))
    build = os.path.join(source, "build")
    if os.path.isdir(build):
        found.update(os.path.join(build, n) for n in os.listdir(build)
                     if n in ("pip", "lib") or n.endswith(".egg-info") or n.startswith(("lib.", "bdist.", "temp.")))
    return found


def outer_venv_site_packages():
    """The site-packages of the venv this script runs in ([] outside a venv)."""
    if sys.prefix == sys.base_prefix:
        return []
    import site
    prefix = os.path.realpath(sys.prefix)
    return [p for p in site.getsitepackages()
            if os.path.isdir(p) and os.path.realpath(p).startswith(prefix + os.sep)]


def inherit_outer_venv(py):
    """Makes the venv of interpreter `py` see the outer venv's site-packages (see the module's doc)."""
    outer = outer_venv_site_packages()
    if not outer:
        return
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                             stdout=subprocess.PIPE, text=True).stdout.strip()
    with open(os.path.join(purelib, "_outer_venv.pth"), "w") as f:
        f.write("".join(p + "\n" for p in outer))
    print("+ the venv sees the outer venv's packages (%s): %s" % (sys.prefix, ", ".join(outer)), flush=True)


def main():
    source, build, work, version = sys.argv[1:5]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    before = litter(source)
    venv = os.path.join(work, "venv")
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    py = os.path.join(venv, "bin", "python")
    inherit_outer_venv(py)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FERRY_POLICY_DIR", "PIP_USER")}
    env.update(FERRY_CMAKE_BUILD_DIR=build, FERRY_PIP_BUILD_BASE=os.path.join(work, "setuptools"),
               FERRY_BUILD_JOBS="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    run([py, "-m", "pip", "install", "--no-build-isolation", "--no-index", "--no-deps", "--no-cache-dir", "-q",
         source], env=env, cwd=work)
    new = litter(source) - before
    if new:
        raise SystemExit("pip install left files in the source tree: %s" % sorted(new))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FERRY_POLICY_DIR")}
    out = run([py, "-m", "ferry", "--version"], env=env, cwd=work, stdout=subprocess.PIPE, text=True).stdout.strip()
    if out != "ferry %s" % version:
        raise SystemExit("python -m ferry --version printed %r, expected 'ferry %s'" % (out, version))
    print(out)
    run([py, os.path.join(os.path.dirname(os.path.abspath(__file__)), "python_package.py"), venv], env=env, cwd=work)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
