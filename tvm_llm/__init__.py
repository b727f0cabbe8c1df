"""tvm_llm: compile a Hugging Face causal LM into a tuned native TVM module and run it.

    import tvm_llm
    tvm_llm.build("path/to/hf_checkpoint", "out/", target="llvm")
    print(tvm_llm.Engine("out/").generate("def fib(n):", max_new_tokens=32))
"""
from .version import __version__  # noqa: F401


# bound eagerly: the submodule tvm_llm.build would otherwise shadow the function once imported
from .build import build  # noqa: E402  (imports no torch at module level)


def __getattr__(name):
    # The runtime is imported lazily so `import tvm_llm` stays light and torch-free.
    if name == "Engine":
        from .runtime.engine import Engine

        return Engine
    raise AttributeError(name)
