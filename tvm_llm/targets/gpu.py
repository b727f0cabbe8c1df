"""What the GPU targets (cuda.py, rocm.py) share: arch validation, the tuning-log key, the
host side of the build and the TIR pipeline for warp-fragment schedules."""
from __future__ import annotations

import os

from .base import TargetSpec
from ..errors import UserError


def host_target() -> dict:
    """The host side of a GPU build: generic x86-64 (the deployment CPU is unknown)."""
    return {"kind": "llvm", "mtriple": f"{os.uname().machine}-linux-gnu"}


class GPUTargetSpec(TargetSpec):
    """A GPU family: subclasses name their archs (`archs`, `default_arch`) and rules."""

    default_dtype = "float16"
    archs: dict = {}
    default_arch = ""

    def __init__(self, arch: str | None = None, **options):
        arch = arch or self.default_arch
        if arch not in self.archs:
            raise UserError(f"unknown --arch {arch!r} for {self.name}: choose one of "
                            f"{', '.join(self.archs)}")
        super().__init__(arch=arch, **options)

    def hw_key(self) -> str:
        return f"{self.name}-{self.arch}"

    def tir_pipeline(self):
        from schedules.gpu import tensor_core_tir_pipeline

        return tensor_core_tir_pipeline()
