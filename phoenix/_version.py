"""The version of phoenix-direct-storage: the one place it is written.

pyproject.toml reads it (``dynamic = ["version"]``) and ``phoenix.__version__`` is it.
Kept free of imports so that the build reads it without importing the package.
"""

__version__ = "0.1.0"
