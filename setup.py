"""The compiled recording core (record/core.py): built where a C compiler and
the Python headers are, skipped with a warning where they are not (the
package then records through its pure-Python path). Everything else is in
pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("sglang_otel_kernels._native", ["sglang_otel_kernels/_native.c"], optional=True,
                             extra_compile_args=["-O2"])])
