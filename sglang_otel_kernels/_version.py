# Raised with each release that changes the trace-file format
# (record/tracefile.py FORMAT_VERSION) or the report's JSON
# (recover/report.py REPORT_SCHEMA), so the version names what a build reads
# and writes (`sglang-otel-kernels --version` says both).
__version__ = "0.13.0"
