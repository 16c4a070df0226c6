"""hyper_adaptor: accelerator-portable Megatron features behind one import line.

megatron-core 0.19.2 declares Python >= 3.12 but ships a cp311 wheel; on Python 3.11 it has to be
installed with ``--no-deps --ignore-requires-python`` after numpy (see DEVELOPERS.md and the
Makefile), which is why it is an extra and not a hard requirement here.
"""

from setuptools import find_packages, setup

setup(
    name="hyper_adaptor",
    version="0.1.0",
    description="Megatron monkey-patch adaptor: HSDP, DTensor parallel, pipeline schedules, "
    "memory features and fused kernels for NPU, CUDA and CPU",
    packages=find_packages(include=["hyper_adaptor", "hyper_adaptor.*"]),
    python_requires=">=3.10",
    # The torch releases the unit and distributed tests have run on (`make test-torch TORCH=...`, README
    # "Supported torch versions"): the floor is the oldest release checked, the ceiling the minor release
    # after the newest checked. The engines use private torch APIs (listed in
    # hyper_adaptor/platform/torch_private.py) that may move in any release, so widening either end means
    # running that target on the new release first. The Makefile installs the exact torch (a CPU build);
    # this range is what pip checks.
    install_requires=["torch>=2.13,<2.16", "numpy", "packaging>=24.2", "einops", "psutil"],
    extras_require={
        "megatron": ["megatron-core==0.19.2"],
        "npu": ["torch_npu"],
        "test": ["pytest>=7", "pytest-timeout"],
    },
    entry_points={"console_scripts": ["hyper-adaptor=hyper_adaptor.cli:main"]},
)
