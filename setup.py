import importlib.util
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HUB_KERNELS = Path(__file__).resolve().parent / "hub_kernels"


SERVE = ["fastapi>=0.115", "uvicorn>=0.30", "pydantic>=2.7", "prometheus-client>=0.20", "llguidance>=1.0"]


class build_py_with_hub_kernel(build_py):
    """Also builds the hub kernel (`hub_kernels/build.py`) into the wheel, as
    `transformers_inkling2/hub_kernels/inkling2_moe/build/`, where `backends.kernel_loading` loads it. An editable
    install loads the checkout's folder instead, which it builds on first use."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        spec = importlib.util.spec_from_file_location("_hub_kernels_build", HUB_KERNELS / "build.py")
        builder = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(builder)
        out = Path(self.build_lib) / "transformers_inkling2" / "hub_kernels" / "inkling2_moe" / "build"
        builder.build(HUB_KERNELS / "inkling2_moe", out)


setup(
    name="transformers-inkling2",
    version="0.1.0",
    description="Thinking Machines' Inkling-2-Small for Hugging Face transformers",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    # the hub kernel ships inside the wheel too, as `transformers_inkling2/hub_kernels/` (backends.kernel_loading):
    # its sources and builder (which the sdist needs to build a wheel), and the build that build_py adds
    package_dir={"": "src", "transformers_inkling2.hub_kernels": "hub_kernels"},
    packages=[*find_packages("src"), "transformers_inkling2.hub_kernels"],
    # the `inkling2` command's argument parsing, outside the package so that `--help` loads no torch
    py_modules=["transformers_inkling2_cli"],
    package_data={
        "transformers_inkling2.nano": ["checkpoint/*"],  # Inkling-2-Nano's weights, tokenizer and processor
        "transformers_inkling2.hub_kernels": [
            "inkling2_moe/build.toml",
            "inkling2_moe/README.md",
            "inkling2_moe/torch-ext/inkling2_moe/*.py",
        ]
    },
    cmdclass={"build_py": build_py_with_hub_kernel},
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
        # `inkling2 serve`: the stack of transformers' own server; llguidance for grammar-constrained replies
        "serve": SERVE,
        # transformers' built-in `inkling2` is the tests' oracle: 5.23 is the version whose numerics and parameter
        # names the tests compare against (5.24 renamed its attention parameters)
        "test": ["transformers==5.23.0", "pytest>=8", "tiktoken>=0.9", "openai>=1.0", "jinja2>=3.1", "peft>=0.21",
                 *SERVE],  # fmt: skip
    },
    entry_points={"console_scripts": ["inkling2=transformers_inkling2_cli:main"]},
)
