"""setuptools' side of pyproject.toml: the extension ferry._ferry is built by CMake (target
ferry_python), not by setuptools' compiler driver.

Environment (all optional):
  FERRY_CMAKE_ARGS       extra arguments for CMake's configure step (e.g. -DFERRY_ENABLE_CUDA=OFF,
                         -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  FERRY_CMAKE_BUILD_DIR  the CMake build tree to use (default: under setuptools' build_temp, kept
                         between pip runs of one source tree, so a rebuild is incremental). A tree
                         that is configured already (it has a CMakeCache.txt) is used as it is: no
                         configure, no changed options (FERRY_CMAKE_ARGS is then ignored); only its
                         target ferry_python is built, a no-op when it is up to date (CI's pip test
                         reuses the tree the other tests run from this way)
  FERRY_PIP_BUILD_BASE   where setuptools writes its build/ and egg-info (default: build/pip in the
                         source tree)
  FERRY_BUILD_JOBS       parallel jobs (default: the CPUs of this process)
"""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_BASE = os.environ.get("FERRY_PIP_BUILD_BASE") or os.path.join("build", "pip")
os.makedirs(BUILD_BASE, exist_ok=True)  # egg_info's egg_base must exist


def version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        m = re.search(r"project\(ferry\b[^)]*\bVERSION\s+([0-9][0-9.]*)", f.read())
    if not m:
        raise RuntimeError("setup.py: no `project(ferry ... VERSION x.y.z)` in CMakeLists.txt")
    return m.group(1)


class CMakeBuild(build_ext):
    """Builds ferry._ferry with CMake and ships the policies and _config.py inside the package."""

    def build_extension(self, ext):
        given = os.environ.get("FERRY_CMAKE_BUILD_DIR")
        build_dir = os.path.abspath(given) if given else os.path.join(os.path.abspath(self.build_temp), "cmake")
        os.makedirs(build_dir, exist_ok=True)
        configured = os.path.exists(os.path.join(build_dir, "CMakeCache.txt"))
        if not (given and configured):  # a given, configured tree is used as it is (see the module's comment)
            configure = ["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release", "-DFERRY_BUILD_TESTS=OFF",
                         "-DFERRY_BUILD_SAMPLES=OFF", "-DFERRY_INSTALL=OFF", "-DFERRY_PYTHON=" + sys.executable]
            if shutil.which("ninja") and not configured:
                configure += ["-G", "Ninja"]
            configure += shlex.split(os.environ.get("FERRY_CMAKE_ARGS", ""))
            subprocess.check_call(configure)
        jobs = os.environ.get("FERRY_BUILD_JOBS") or str(len(os.sched_getaffinity(0)))
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "ferry_python", "-j", jobs])
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        built = glob.glob(os.path.join(build_dir, "python", "ferry", "_ferry*.so"))
        if len(built) != 1:
            raise RuntimeError("setup.py: CMake built %s, expected one python/ferry/_ferry*.so under %s (is the "
                               "Python package ON? see CMake's 'ferry: Python package' line)" % (built, build_dir))
        if not built[0].endswith(suffix):
            raise RuntimeError("setup.py: %s was built for another Python than this one (%s, extension suffix %s): "
                               "configure %s with -DFERRY_PYTHON=%s, or leave FERRY_CMAKE_BUILD_DIR unset"
                               % (built[0], sys.executable, suffix, build_dir, sys.executable))
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built[0], target)
        package = os.path.dirname(target)
        policies = os.path.join(package, "policies")
        os.makedirs(policies, exist_ok=True)
        for lua in glob.glob(os.path.join(ROOT, "scripts", "policies", "*.lua")):
            shutil.copyfile(lua, os.path.join(policies, os.path.basename(lua)))
        with open(os.path.join(ROOT, "bindings", "python", "_config.py.in")) as f:
            config = f.read().replace("@FERRY_PY_POLICY_DIR@", "policies").replace("@PROJECT_VERSION@", version())
        with open(os.path.join(package, "_config.py"), "w") as f:
            f.write(config)


setup(
    version=version(),
    ext_modules=[Extension("ferry._ferry", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    options={"build": {"build_base": BUILD_BASE}, "egg_info": {"egg_base": BUILD_BASE}},
    zip_safe=False,
)
