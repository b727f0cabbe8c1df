"""What this CPU and OS let a process run: the kernel's CPU flags and the AMX permission. Used
by the build (which kernels the host target gets) and by the runtime (a build with AMX kernels
asks for the tile state before its first call)."""
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
