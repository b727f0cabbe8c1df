"""Auto-tuning: MetaSchedule with the XGBoost cost model, one log per hardware key.

    tvm-llm tune MODEL_DIR --trials 32            # -> autotune_logs/<hw-key>/
    tvm-llm build MODEL_DIR -o OUT --tuning-log autotune_logs/<hw-key>

* buckets.py  static shape-bucket copies of the symbolic kernels, and their run-time dispatch
* log.py      the MetaSchedule JSON database: tolerant reading, locked appends, hw keys
* tuner.py    task extraction after our "lowering" phase, tuning, progress, RPC measurement
* apply.py    the build's first scheduling pass: bucket copies + the log's schedules
"""
from __future__ import annotations


def tune(*args, **kwargs):
    from .tuner import tune as _tune

    return _tune(*args, **kwargs)


def apply_tuning_log(*args, **kwargs):
    from .apply import apply_tuning_log as _apply

    return _apply(*args, **kwargs)
