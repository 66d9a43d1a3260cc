from setuptools import find_packages, setup

setup(
    name="localmap_fx",
    version="0.1.0",
    description="local_map for DTensor programs that survives torch.compile",
    packages=find_packages(include=["localmap_fx", "localmap_fx.*"]),
    # Registers TORCH_LOGS names while torch imports (see the module docstring).
    py_modules=["_localmap_fx_logs"],
    python_requires=">=3.11",
    install_requires=["torch==2.14.1", "spmd-types==0.3.1"],
    entry_points={
        "torch_dynamo_backends": ["localmap_fx = localmap_fx.compiler:localmap_fx_backend"],
        "console_scripts": ["localmap-fx = localmap_fx.debug.cli:main"],
        # torch calls these during `import torch`, before it parses TORCH_LOGS.
        "torch.backends": ["localmap_fx_logs = _localmap_fx_logs:register"],
    },
    extras_require={
        "test": ["pytest", "expecttest", "hypothesis"],
        # PNG output of `localmap-fx inspect --png` (SVG needs nothing)
        "pictures": ["pillow"],
    },
)
