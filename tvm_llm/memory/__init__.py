"""Memory: the static activation plan, the KV page budget, and the figures users see.

    kv_budget.py   --max-memory parsing and the KV pool arithmetic (pure numbers)
    planner.py     activations from TVM's static block-memory plan + the whole plan

The plan is printed by `tvm-llm build` and `tvm-llm plan` and stored in the manifest's
"memory" section; tvm_llm.report.format_memory prints it for every command.
"""
from .kv_budget import Budget, KVPool, kv_bytes_per_token, parse_budget  # noqa: F401
from .planner import MemoryPlan, activation_plan, plan_memory  # noqa: F401
