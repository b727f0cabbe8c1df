"""tvm_llm: Hugging Face decoders -> tuned TVM modules for CPU, CUDA and ROCm."""
from setuptools import find_packages, setup

setup(
    name="tvm_llm",
    version="0.1.0",
    description="Compile Hugging Face LLM checkpoints into tuned native TVM modules (CPU, CUDA, ROCm).",
    python_requires=">=3.10",
    packages=find_packages(include=["tvm_llm", "tvm_llm.*", "schedules", "schedules.*"]),
    package_data={"tvm_llm": ["default_model/*", "quantization/calibration.txt"]},
    include_package_data=True,
    install_requires=[
        "apache-tvm==0.27.0.post1",
        "apache-tvm-ffi==0.1.14.post1",  # newer releases segfault in tvm.ir.save_json
        "torch==2.13.0",  # exact: the CPU build on disk; a looser spec pulls a CUDA build
        "transformers>=5.0,<6",
        "safetensors",
        "tokenizers",
        "numpy",
        "xgboost-cpu",  # same `xgboost` module without the CUDA/NCCL payload
        "psutil",  # MetaSchedule's XGBoost model
        "cloudpickle",  # MetaSchedule worker pools
        "tornado",  # TVM RPC
        "ziglang",  # LLVM-22 ld.lld for ROCm code objects and cross links
        "starlette>=0.37,<2",  # tvm-llm serve: ASGI routes and server-sent events
        "uvicorn>=0.30,<1",  # tvm-llm serve: the ASGI server (graceful SIGTERM drain)
        "uvloop>=0.19,<1; sys_platform != 'win32'",  # serve: uvicorn's faster event loop
        "httptools>=0.6,<1",  # serve: uvicorn's C HTTP parser (h11 otherwise: more CPU per token)
        "jinja2>=3.1,<4",  # chat templates, rendered in jinja2's sandbox
        "prometheus-client>=0.20,<1",  # tvm-llm serve: /metrics
    ],
    extras_require={"test": ["pytest", "openai>=1.40,<4"],  # openai: the serve tests' client
                    "report": ["matplotlib"]},  # scripts/memory_report.py plots
    entry_points={"console_scripts": ["tvm-llm = tvm_llm.cli:main"]},
)
