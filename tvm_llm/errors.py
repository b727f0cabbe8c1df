"""The one exception type users see: a one-line message naming the problem and the fix.

The CLI turns it into that line on stderr and exit code 2; anything else is a bug in tvm_llm.
"""


class UserError(Exception):
    """Bad input from the user (a path, a checkpoint, an option). Exit code 2."""

    exit_code = 2


class NonFiniteWarning(UserWarning):
    """Weights or outputs hold NaN or Inf: the work goes on, its results are not numbers. The
    CLI prints it as one `tvm-llm: warning:` line."""
