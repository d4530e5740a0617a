"""setuptools' side of pyproject.toml: the extension ferry._ferry is built by CMake (target
ferry_python), not by setuptools' compiler driver.

Environment (all optional):
  FERRY_CMAKE_ARGS       extra arguments for CMake's configure step (e.g. -DFERRY_ENABLE_CUDA=OFF,
                         -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  FERRY_CMAKE_BUILD_DIR  the CMake build tree to use (default: under setuptools' build_temp, kept
                         between pip runs of one source tree, so a rebuild is incremental)
  FERRY_BUILD_JOBS       parallel jobs (default: the CPUs of this process)
"""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        m = re.search(r"project\(ferry\b[^)]*\bVERSION\s+([0-9][0-9.]*)", f.read())
    if not m:
        raise RuntimeError("setup.py: no `project(ferry ... VERSION x.y.z)` in CMakeLists.txt")
    return m.group(1)


class CMakeBuild(build_ext):
    """Builds ferry._ferry with CMake and ships the policies and _config.py inside the package."""

    def build_extension(self, ext):
        build_dir = os.environ.get("FERRY_CMAKE_BUILD_DIR") or os.path.join(os.path.abspath(self.build_temp), "cmake")
        os.makedirs(build_dir, exist_ok=True)
        configure = ["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release", "-DFERRY_BUILD_TESTS=OFF",
                     "-DFERRY_BUILD_SAMPLES=OFF", "-DFERRY_INSTALL=OFF", "-DFERRY_PYTHON=" + sys.executable]
        if shutil.which("ninja") and not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            configure += ["-G", "Ninja"]
        configure += shlex.split(os.environ.get("FERRY_CMAKE_ARGS", ""))
        jobs = os.environ.get("FERRY_BUILD_JOBS") or str(len(os.sched_getaffinity(0)))
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "ferry_python", "-j", jobs])
        built = glob.glob(os.path.join(build_dir, "python", "ferry", "_ferry*.so"))
        if len(built) != 1:
            raise RuntimeError("setup.py: CMake built %s, expected one python/ferry/_ferry*.so under %s (is the "
                               "Python package ON? see CMake's 'ferry: Python package' line)" % (built, build_dir))
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
    options={"build": {"build_base": os.environ.get("FERRY_PIP_BUILD_BASE", os.path.join("build", "pip"))},
             "egg_info": {"egg_base": os.path.join("build")}},
    zip_safe=False,
)
