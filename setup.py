from setuptools import find_packages, setup

setup(
    name="xla_fsdp",
    version="0.1.0",
    description="Fully Sharded Data Parallel (ZeRO-3) for PyTorch on XLA devices, with "
                "streaming checkpoint consolidation",
    packages=find_packages(include=["xla_fsdp", "xla_fsdp.*"]),
    python_requires=">=3.10,<3.14",
    # torch_xla 2.9.0 declares no torch pin, but its C++ ABI needs torch 2.9.x.
    install_requires=["torch==2.9.0", "torch_xla==2.9.0", "numpy"],
    # the clients that import torch_xla's FSDP themselves, tested through patch_torch_xla()
    extras_require={"test": ["pytest>=7", "pytest-xdist>=3.5", "safetensors", "transformers<5", "accelerate",
                             "peft", "lightning==2.6.6", "matplotlib",
                             "jax==0.7.1", "jaxlib==0.7.1", "torchax==0.0.7"],
                    # torch_xla's Pallas kernels (flash and splash attention) need the jax
                    # torch_xla 2.9 pins (its own 'pallas' extra), splash torchax too; a
                    # plan of a step that calls them lowers them with it; torchax 0.0.7
                    # imports flax without declaring it
                    "pallas": ["jax==0.7.1", "jaxlib==0.7.1", "torchax==0.0.7", "flax==0.12.0"],
                    "example": ["matplotlib"],  # examples/train_lm.py's loss curve
                    # the TPU compiler for xla_fsdp.aot; on Python < 3.12 it lives in an
                    # environment of its own: `python -m xla_fsdp.aot install`
                    "tpu": ["jax[tpu]==0.12.0.1; python_version >= '3.12'"]},
    entry_points={"console_scripts": [
        "consolidate_sharded_ckpts = xla_fsdp.checkpoint.consolidate.cli:main",
    ]},
)
