"""Carry apache-tvm to an offline GPU machine whose uploads are capped below the wheel's size.

apache-tvm's wheel is ~100 MB (libtvm_compiler.so alone is 259 MB unpacked); a lent GPU machine
here takes at most 64 MiB per call and reaches no package registry. `pack` downloads the wheels
for the machine's Python (apache-tvm, apache-tvm-ffi), puts everything but the compiler library
into one small tar.xz and the compiler, xz-compressed (~59 MB), into parts of at most
--part-mb; `unpack`, on the GPU machine, rebuilds the site folder and checks the library's
sha256. Carry part 0 in one call and copy it out of the tree there (the next call's carry
replaces the folder), the rest in the next call, while the machine is still warm:

    python scripts/pack_tvm_offline.py pack --out .tvm_offline       # here (.gitignore'd)
    mv .tvm_offline/part1 /tmp/part1                                  # here: call 1 carries part0
    mkdir -p /tmp/p && cp -r .tvm_offline/part0 /tmp/p/               # there: call 1
    mv /tmp/part1 .tvm_offline/ && rm -r .tvm_offline/part0           # here: call 2 carries the rest
    TVM_OFFLINE_PARTS="/tmp/p .tvm_offline" bash scripts/gpu_check.sh # there: call 2 (unpacks)
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import io
import lzma
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

COMPILER = "tvm/lib/libtvm_compiler.so"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def pack(out: str, python: str, part_mb: float, tvm: str, ffi: str) -> None:
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", "-d", tmp,
               *sum((["--platform", p] for p in PLATFORMS), []),
               f"apache-tvm=={tvm}", f"apache-tvm-ffi=={ffi}"]
        subprocess.run(cmd, check=True)
        rest, compiler = io.BytesIO(), None
        with tarfile.open(fileobj=rest, mode="w") as tar:
            for wheel in sorted(glob.glob(os.path.join(tmp, "*.whl"))):
                with zipfile.ZipFile(wheel) as z:
                    for info in z.infolist():
                        if info.is_dir() or info.filename.startswith("tvm/web/"):
                            continue
                        data = z.read(info)
                        if info.filename == COMPILER:
                            compiler = data
                            continue
                        member = tarfile.TarInfo(info.filename)
                        member.size, member.mode = len(data), 0o755 if data[:4] == b"\x7fELF" else 0o644
                        tar.addfile(member, io.BytesIO(data))
    assert compiler is not None, f"{COMPILER} not in the apache-tvm wheel"
    with open(os.path.join(out, "site_rest.tar.xz"), "wb") as f:
        f.write(lzma.compress(rest.getvalue(), preset=9))
    with open(os.path.join(out, "compiler.sha256"), "w") as f:
        f.write(hashlib.sha256(compiler).hexdigest())
    packed = lzma.compress(compiler, preset=9 | lzma.PRESET_EXTREME)
    size = int(part_mb * 1e6)
    for i in range(0, len(packed), size):
        part_dir = os.path.join(out, f"part{i // size}")
        os.makedirs(part_dir, exist_ok=True)
        with open(os.path.join(part_dir, "compiler.xz"), "wb") as f:
            f.write(packed[i:i + size])
    print(f"{out}: site_rest.tar.xz, compiler.sha256, {len(range(0, len(packed), size))} parts "
          f"of <= {part_mb} MB ({len(packed) / 1e6:.1f} MB of compressed compiler)")


def fail(message: str) -> None:
    """A bad pack: one line on stderr, exit status 2."""
    print(message, file=sys.stderr)
    sys.exit(2)


def unpack(folders: list, site: str) -> None:
    """`folders`: where the parts and the small files are (part<i>/compiler.xz below any)."""
    def find(rel):
        return [os.path.join(d, rel) for d in folders if os.path.exists(os.path.join(d, rel))]

    parts, i = [], 0
    while found := find(f"part{i}/compiler.xz"):
        parts.append(found[0])
        i += 1
    if not parts or not find("site_rest.tar.xz") or not find("compiler.sha256"):
        fail(f"unpack: parts, site_rest.tar.xz or compiler.sha256 missing under {folders} (a "
             "fresh machine lost the part carried by an earlier call?): pack again and carry both")
    try:
        data = lzma.decompress(b"".join(open(p, "rb").read() for p in parts))
    except lzma.LZMAError:
        data = b""   # a part cut short or out of order: the sha256 check below names it
    if hashlib.sha256(data).hexdigest() != open(find("compiler.sha256")[0]).read().strip():
        fail("unpack: libtvm_compiler.so does not match its sha256 (a part is missing or from "
             "another pack): carry every part of one pack")
    # checked before anything is written: a bad pack leaves no half-made site folder
    os.makedirs(site, exist_ok=True)
    with tarfile.open(find("site_rest.tar.xz")[0]) as tar:
        tar.extractall(site)
    with open(os.path.join(site, COMPILER), "wb") as f:
        f.write(data)
    print(f"unpack: TVM in {site} ({len(parts)} parts); export PYTHONPATH={site}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--out", default=".tvm_offline")
    p.add_argument("--python", default="3.12", help="the GPU machine's Python version")
    p.add_argument("--part-mb", type=float, default=45.0)
    p.add_argument("--tvm", default="0.27.0.post1")
    p.add_argument("--ffi", default="0.1.14.post1")
    u = sub.add_parser("unpack")
    u.add_argument("--parts", nargs="+", required=True)
    u.add_argument("--site", default="/tmp/site")
    a = ap.parse_args()
    if a.cmd == "pack":
        pack(a.out, a.python, a.part_mb, a.tvm, a.ffi)
    else:
        unpack(a.parts, a.site)


if __name__ == "__main__":
    main()
