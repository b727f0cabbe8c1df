"""Our schedule rules, one folder per target family (cpu/, cuda/, rocm/).

Each rule is a `tvm.s_tir.dlight.ScheduleRule`: it claims the kernels it knows how to
schedule (returns None for the rest) and is tried before TVM's generic fallbacks.
"""
