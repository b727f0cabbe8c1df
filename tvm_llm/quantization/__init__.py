"""Weight quantization (q8/q4, W8A8): the schemes, their kernels, and precision tools.

scheme.py    what the options mean, and the numpy reference rounding
formats.py   weight formats (q8_0, q4_0, q4_1, q3_k-q6_k): numpy reference quantizers
plan.py      QuantPlan: the format of each weight of a build
kernels.py   the tensor expressions the QuantizeLinear pass (passes/quantize_linear.py) emits
"""
from .scheme import QuantScheme, parse_scheme  # noqa: F401
