"""What this CPU and OS let a process run: the kernel's CPU flags, the AMX permission, and the
LLVM target that describes this CPU. Used by the build (the host target: targets/llvm.py; the
build machine's own helper kernels: quantization/kquant_search.py) and by the runtime (a build
with AMX kernels asks for the tile state before its first call)."""
from __future__ import annotations

import os

ARCH_REQ_XCOMP_PERM = 0x1023  # arch_prctl code (Linux >= 5.16, asm/prctl.h)
XFEATURE_XTILEDATA = 18  # the AMX tile data state component
SYS_ARCH_PRCTL_X86_64 = 158


def host_cpu_flags() -> set:
    """The kernel's feature flags of this CPU (/proc/cpuinfo), empty where unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def request_amx_permission() -> tuple[bool, str]:
    """Ask Linux for AMX tile state in this process (arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)): a process must do this before its first AMX instruction, and the
    kernel refuses it on CPUs without AMX, on kernels older than 5.16, or when the tile state
    does not fit the signal stack. Returns (granted, why)."""
    import ctypes
    import errno

    if os.uname().machine != "x86_64" or not os.uname().sysname == "Linux":
        return False, "not x86_64 Linux"
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(SYS_ARCH_PRCTL_X86_64, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if rc == 0:
        return True, "granted"
    err = ctypes.get_errno()
    return False, f"refused ({errno.errorcode.get(err, err)})"


def host_cpu_name() -> str:
    """LLVM's name for this CPU (e.g. znver4, sapphirerapids). TVM's "native" falls back to
    generic SSE code, so the build always names the CPU explicitly."""
    import tvm

    return str(tvm.target.codegen.llvm_get_system_cpu())


# /proc/cpuinfo flag -> LLVM feature, for the vector features our kernels choose by
HOST_FLAG_FEATURES = {
    "avx2": "avx2", "fma": "fma", "f16c": "f16c",
    "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512vl": "avx512vl", "avx512dq": "avx512dq",
    "avx512cd": "avx512cd", "avx512vbmi": "avx512vbmi", "avx512_vbmi2": "avx512vbmi2",
    "avx512ifma": "avx512ifma", "avx512_bitalg": "avx512bitalg",
    "avx512_vpopcntdq": "avx512vpopcntdq", "avx512_vnni": "avx512vnni", "avx_vnni": "avxvnni",
    "avx512_bf16": "avx512bf16", "avx512_fp16": "avx512fp16",
    "amx_tile": "amx-tile", "amx_bf16": "amx-bf16", "amx_int8": "amx-int8",
}


AMX_FLAGS = {"amx_tile", "amx_bf16", "amx_int8"}


def host_feature_attrs(cpu: str, flags: set | None = None) -> list[str]:
    """LLVM ``mattr`` entries that make the CPU name's features the host's own: LLVM names the
    host by its family/model number, which virtual machines may mask (an AMX Xeon VM here
    reports a Rocket Lake model, so its name lacks AVX512-BF16, AVX512-FP16 and AMX), or a
    hypervisor may hide features the name implies (code using them would die by SIGILL).
    ``+f`` for a flag the kernel reports that the name lacks, ``-f`` for the reverse; nothing
    where /proc/cpuinfo is unreadable or the host is not x86_64."""
    import tvm

    flags = host_cpu_flags() if flags is None else flags
    if not flags or os.uname().machine != "x86_64":
        return []
    base = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": cpu})
    out = []
    for flag, feature in HOST_FLAG_FEATURES.items():
        has = bool(tvm.target.codegen.llvm_cpu_has_features(feature, base))
        if (flag in flags) != has:
            out.append(("+" if flag in flags else "-") + feature)
    return out


def missing_cpu_features(tvm_target_json: str, flags: set | None = None) -> list[str]:
    """The /proc/cpuinfo flags whose instructions a build's x86 code may use (its LLVM target's
    features among HOST_FLAG_FEATURES; AMX apart, see runtime/artifact.py check_amx) and this
    CPU lacks: a build made for a newer CPU would die by SIGILL at its first such instruction.
    [] where the build or the host is not x86_64 or /proc/cpuinfo is unreadable."""
    import json

    import tvm

    flags = host_cpu_flags() if flags is None else flags
    spec = json.loads(tvm_target_json)
    if not flags or os.uname().machine != "x86_64" or not str(spec.get("mtriple", "")).startswith("x86_64"):
        return []
    target = tvm.target.Target({k: v for k, v in spec.items() if k not in ("tag", "keys")})
    return [flag for flag, feature in HOST_FLAG_FEATURES.items()
            if flag not in AMX_FLAGS and flag not in flags
            and tvm.target.codegen.llvm_cpu_has_features(feature, target)]


def host_target(num_cores: int | None = None):
    """The TVM target of this CPU: LLVM's name for it with its real vector features
    (host_feature_attrs), AMX left out where Linux refuses the tile state."""
    import tvm

    spec = {"kind": "llvm", "mtriple": f"{os.uname().machine}-linux-gnu", "mcpu": host_cpu_name()}
    if num_cores:
        spec["num-cores"] = num_cores
    flags = host_cpu_flags()
    if flags & AMX_FLAGS and not request_amx_permission()[0]:
        flags = flags - AMX_FLAGS  # AMX code would die by SIGILL in this process
    mattr = host_feature_attrs(spec["mcpu"], flags)
    if mattr:
        spec["mattr"] = mattr
    return tvm.target.Target(spec)
