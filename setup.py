"""diversed_jax: relaxed speculative decoding (DIVERSED) in JAX/Flax."""

from setuptools import find_packages, setup

setup(
    name="diversed_jax",
    version="0.1.0",
    description="Relaxed speculative decoding with learned ensemble verification (DIVERSED) in JAX",
    packages=find_packages(include=["diversed_jax", "diversed_jax.*"]),
    package_data={"diversed_jax": ["data/**/*", "assets/**/*", "models/cpu_kernels/*.cc",
                                   "models/cpu_kernels/*.h"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.6.2",  # jax.shard_map and jax.ffi (the suite runs on 0.10)
        "flax>=0.10",
        "optax>=0.2.3",
        "orbax-checkpoint>=0.10",
        "transformers>=4.50",
        "tokenizers",
        "datasets",
        "rouge-score",
        "ml-collections",
        "absl-py",
        "chex",
        "gguf>=0.10",
        "safetensors",
        "numpy",
        "matplotlib",
        "tensorboardX",
        "sentencepiece",
        "protobuf",
    ],
    extras_require={
        # Test-only references: transformers' PyTorch models to check parity. A CPU build is
        # all the tests need; where pip's index serves CUDA builds, install torch from
        # https://download.pytorch.org/whl/cpu first.
        "test": ["torch==2.13.0", "accelerate", "pytest", "pytest-xdist", "nbformat", "nbclient",
                 "ipykernel"],
        "gpu": ["jax[cuda12]"],
        "tpu": ["jax[tpu]"],
    },
)
