"""The compiled recording core (record/core.py): built where a C compiler and
the Python headers are, skipped with a warning where they are not (the
package then records through its pure-Python path). Everything else is in
pyproject.toml."""

import glob

from setuptools import Extension, setup

# One translation unit: _native.c includes the files of native/, each one job.
setup(ext_modules=[Extension("sglang_otel_kernels._native", ["sglang_otel_kernels/_native.c"], optional=True,
                             depends=sorted(glob.glob("sglang_otel_kernels/native/*")), extra_compile_args=["-O2"])])
