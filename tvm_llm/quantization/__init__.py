"""Weight quantization (q8/q4, W8A8): the schemes, their kernels, and precision tools.

scheme.py    what the options mean, and the numpy reference rounding
kernels.py   the tensor expressions the QuantizeLinear pass (passes/quantize_linear.py) emits
"""
from .scheme import QuantScheme, parse_scheme  # noqa: F401
