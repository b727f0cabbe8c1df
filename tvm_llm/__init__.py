"""tvm_llm: compile a Hugging Face causal LM into a tuned native TVM module and run it.

    import tvm_llm
    tvm_llm.build("path/to/hf_checkpoint", "out/", target="llvm")
    print(tvm_llm.Engine("out/").generate("def fib(n):", max_new_tokens=32))
"""
__version__ = "0.1.0"


def build(*args, **kwargs):
    """Compile a checkpoint directory into an output directory; see tvm_llm.build_api.build."""
    from .build import build as _build

    return _build(*args, **kwargs)


def __getattr__(name):
    # The runtime is imported lazily so `import tvm_llm` stays light and torch-free.
    if name == "Engine":
        from .runtime.engine import Engine

        return Engine
    raise AttributeError(name)
