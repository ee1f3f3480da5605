# Builds deltastack's torch extension (deltastack.torch._C) against the installed torch:
#   pip install --no-build-isolation ./python        (from the repository root; docs/torch.md)
# It configures the repository's CMake project into python/build/kernels-<cpu|cuda>/ and builds only the
# deltastack_kernels static library (src/core + src/ops, position-independent), then compiles python/csrc with
# torch.utils.cpp_extension and links that library. Environment:
#   DELTASTACK_TORCH_CPU_ONLY=1   build without CUDA (CPU reference only), even where nvcc and a CUDA torch exist;
#   DELTASTACK_KERNELS_BUILD=DIR  use an existing CMake build directory's libdeltastack_kernels.a instead (it must
#                                 have been configured with the same DELTASTACK_CUDA setting);
#   DELTASTACK_CMAKE_ARGS="..."   extra arguments for the CMake configure step;
#   MAX_JOBS=N                    parallel build jobs (default 2);
#   PKG_CONFIG=EXE                the pkg-config that finds fmt and OpenBLAS (scripts/device_test.sh: its sysroot's).
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
ROOT = Path(os.environ.get("DELTASTACK_SOURCE_DIR", HERE.parent)).resolve()


def _truthy(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _pkg_config(pkg, flag):
    try:
        exe = os.environ.get("PKG_CONFIG", "pkg-config")
        out = subprocess.run([exe, flag, pkg], check=True, capture_output=True, text=True).stdout
        return shlex.split(out)
    except (OSError, subprocess.CalledProcessError):
        return []


def _want_cuda():
    if _truthy("DELTASTACK_TORCH_CPU_ONLY"):
        return False
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None


def _build_kernels(cuda):
    given = os.environ.get("DELTASTACK_KERNELS_BUILD")
    if given:
        lib = Path(given) / "libdeltastack_kernels.a"
        if not lib.exists():
            sys.exit(f"DELTASTACK_KERNELS_BUILD={given}: no libdeltastack_kernels.a there")
        return lib
    if not (ROOT / "CMakeLists.txt").exists():
        sys.exit(f"deltastack sources not found at {ROOT} (set DELTASTACK_SOURCE_DIR to the repository root)")
    build = HERE / "build" / ("kernels-cuda" if cuda else "kernels-cpu")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = ["cmake", "-S", str(ROOT), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release", "-DDELTASTACK_TESTS=OFF",
           f"-DDELTASTACK_CUDA={'ON' if cuda else 'OFF'}", *shlex.split(os.environ.get("DELTASTACK_CMAKE_ARGS", ""))]
    print("deltastack: " + " ".join(cfg), flush=True)
    subprocess.run(cfg, check=True)
    jobs = os.environ.get("MAX_JOBS", "2")
    subprocess.run(["cmake", "--build", str(build), "--target", "deltastack_kernels", "-j", jobs], check=True)
    return build / "libdeltastack_kernels.a"


def _torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("deltastack: torch is not importable in the build environment: build against the installed torch "
                 "with `pip install --no-build-isolation ./python` (an isolated build has no torch)")


def _extension():
    _torch()
    from torch.utils import cpp_extension

    cuda = _want_cuda()
    lib = _build_kernels(cuda)
    cxx = ["-O2", "-std=c++20", "-fopenmp"]
    libs = _pkg_config("fmt", "--libs") or ["-lfmt"]
    libs += _pkg_config("openblas", "--libs") or ["-lopenblas"]
    link = [str(lib), *libs, "-fopenmp", "-ldl"]
    kw = dict(sources=["csrc/deltastack_torch.cpp"], include_dirs=[str(ROOT / "src")],
              extra_compile_args={"cxx": cxx}, extra_link_args=link)
    if cuda:
        kw["define_macros"] = [("DELTASTACK_TORCH_CUDA", "1"), ("DELTASTACK_CUDA", "1")]
        kw["libraries"] = ["cudart", "cublasLt", "cublas"]
        return cpp_extension.CUDAExtension("deltastack.torch._C", **kw)
    return cpp_extension.CppExtension("deltastack.torch._C", **kw)


_EXCEPTION_CHECK = """
import importlib.util, sys
import torch  # noqa: F401  (the extension links libtorch; importing torch first loads it as the package does)
spec = importlib.util.spec_from_file_location("deltastack.torch._C", sys.argv[1])
m = importlib.util.module_from_spec(spec)
try:
    spec.loader.exec_module(m)
except Exception as e:  # not a crash: the extension does not load here (a missing library, ...)
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(5)
try:
    m._raise_check("deltastack exception check")
except RuntimeError as e:
    sys.exit(0 if "deltastack exception check" in str(e) else 3)
sys.exit(4)
"""


def _exception_check(path):
    """Imports the built extension in a fresh process and has it throw a c10::Error: it must arrive in Python as a
    RuntimeError. An extension whose C++ exceptions cannot cross into torch crashes on the first bad argument; on the
    H200 image an extension built by its CXX=/opt/gcc/bin/g++ wrapper did (a segmentation fault in any TORCH_CHECK),
    one built by /usr/bin/g++ did not. A crash (or a wrong error) removes the built file and exits with an error
    naming the compiler; an extension that cannot be imported in the build environment at all is only a warning."""
    r = subprocess.run([sys.executable, "-c", _EXCEPTION_CHECK, str(path)], capture_output=True, text=True)
    if r.returncode == 0:
        print(f"deltastack: exception check passed ({path})", flush=True)
        return
    if r.returncode == 5:
        print(f"deltastack: warning: the exception check could not import {path} here, so it did not run: "
              f"{r.stderr.strip()[-400:]}", flush=True)
        return
    cxx = os.environ.get("CXX", "c++ (the default)")
    how = {3: "it raised RuntimeError without the message", 4: "it raised nothing"}.get(
        r.returncode, f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit status {r.returncode}")
    Path(path).unlink(missing_ok=True)  # a later import (or a kept build) must not load it
    sys.exit(f"deltastack: the built extension {path} (now removed) cannot raise C++ errors into Python: a c10::Error "
             f"thrown in it did not arrive as RuntimeError ({how}). It was compiled by CXX={cxx}. Rebuild with "
             f"the system compiler, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc (the compiler torch was built with; "
             f"docs/torch.md). stderr: {r.stderr.strip()[-400:]}")


def _build_ext():
    from torch.utils.cpp_extension import BuildExtension

    base = BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)

    class Build(base):
        def run(self):
            super().run()
            for ext in self.extensions:
                _exception_check(self.get_ext_fullpath(ext.name))

    return Build


if any(a in sys.argv for a in ("build_ext", "bdist_wheel", "install", "develop", "editable_wheel", "build")):
    ext_modules, cmdclass = [_extension()], {"build_ext": _build_ext()}
else:
    ext_modules, cmdclass = [], {}

setup(
    name="deltastack",
    version="0.1.0",
    description="deltastack's kernels (Gated DeltaNet, conv1d, norms, SwiGLU, fused linear CE) as torch custom ops",
    packages=find_packages(include=["deltastack", "deltastack.*"]),
    python_requires=">=3.9",
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
