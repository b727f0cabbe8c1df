"""Build llama.cpp's native `llama-server` (and `llama-quantize`) once, as a benchmark reference.

    python scripts/llamacpp_server.py            # prints the path of llama-server when built

A benchmark reference only, never a dependency of tvm_llm. The sources are the llama.cpp tree
vendored in the llama-cpp-python 0.3.36 sdist (the same sources scripts/llamacpp_ref.py uses),
fetched with pip and built with the machine's cmake/gcc under ~/.cache/tvm_llm/llamacpp/:

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36
    cmake -S vendor/llama.cpp -B build -DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF
          -DLLAMA_BUILD_SERVER=ON
    cmake --build build --target llama-server llama-quantize -j2

On Intel machines whose native build dies with *Illegal instruction* (AMX, see
/work/shared/ANCHORS.md) pass --no-amx: it builds with GGML_NATIVE=OFF and AVX-512/VNNI on, AMX off.
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tarfile

VERSION = "0.3.36"
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tvm_llm", "llamacpp")
NATIVE = ["-DGGML_NATIVE=ON"]
NO_AMX = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
          "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
          "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def _log(msg: str) -> None:
    print(f"# llamacpp_server: {msg}", file=sys.stderr, flush=True)


def _source_dir() -> str:
    """The unpacked sdist (downloaded with pip on first use)."""
    os.makedirs(CACHE, exist_ok=True)
    src = os.path.join(CACHE, f"llama_cpp_python-{VERSION}-src")
    if os.path.isdir(os.path.join(src, "vendor", "llama.cpp")):
        return src
    sdists = glob.glob(os.path.join(CACHE, f"llama_cpp_python-{VERSION}.tar.gz"))
    if not sdists:
        _log(f"downloading the llama-cpp-python {VERSION} sdist with pip")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={VERSION}", "-d", CACHE], check=True)
        sdists = glob.glob(os.path.join(CACHE, f"llama_cpp_python-{VERSION}.tar.gz"))
    tmp = src + ".unpack"
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(tmp)
    (top,) = os.listdir(tmp)
    os.rename(os.path.join(tmp, top), src)
    os.rmdir(tmp)
    return src


def build(no_amx: bool = False, jobs: int = 2) -> str:
    """Path of the built llama-server binary (built on first use, then cached)."""
    build_dir = os.path.join(CACHE, "build-noamx" if no_amx else "build")
    exe = os.path.join(build_dir, "bin", "llama-server")
    if os.path.isfile(exe) and os.path.isfile(os.path.join(build_dir, "bin", "llama-quantize")):
        return exe
    src = os.path.join(_source_dir(), "vendor", "llama.cpp")
    flags = NO_AMX if no_amx else NATIVE
    _log(f"configuring {src} -> {build_dir}")
    subprocess.run(["cmake", "-S", src, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release", *flags,
                    "-DGGML_BLAS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON"], check=True)
    _log(f"building llama-server and llama-quantize with -j{jobs} (about 10 minutes on 2 cores)")
    subprocess.run(["cmake", "--build", build_dir, "--target", "llama-server", "llama-quantize",
                    f"-j{jobs}"], check=True)
    return exe


def quantize_exe(no_amx: bool = False) -> str:
    return os.path.join(os.path.dirname(build(no_amx)), "llama-quantize")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-amx", action="store_true", help="GGML_NATIVE=OFF build with AMX off")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    print(build(args.no_amx, args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
