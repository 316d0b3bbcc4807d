from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="transformers-inkling2",
    version="0.1.0",
    description="Thinking Machines' Inkling-2-Small for Hugging Face transformers",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    # the hub kernel package ships inside the wheel too, as `transformers_inkling2/hub_kernels/` (kernel_loading)
    package_dir={"": "src", "transformers_inkling2.hub_kernels": "hub_kernels"},
    packages=[*find_packages("src"), "transformers_inkling2.hub_kernels"],
    package_data={"transformers_inkling2.hub_kernels": ["inkling2_moe/build.toml", "inkling2_moe/build/**/*"]},
    python_requires=">=3.10",
    install_requires=[
        "transformers>=5.23,<6",
        "torch>=2.8",
        "accelerate>=1.10",
        "safetensors>=0.6",
        "kernels>=0.17.2",
        "pillow>=10.1",
        # ships o200k_base.tiktoken, from which the tokenizer is built offline
        "tml-renderers>=0.2.1",
    ],
    extras_require={
        # transformers' built-in `inkling2` is the tests' oracle: 5.23 is the version whose numerics and parameter
        # names the tests compare against (5.24 renamed its attention parameters)
        "test": ["transformers==5.23.0", "pytest>=8", "tiktoken>=0.9", "openai>=1.0", "jinja2>=3.1", "peft>=0.21"],
    },
    entry_points={"console_scripts": ["inkling2=transformers_inkling2.cli:main"]},
)
