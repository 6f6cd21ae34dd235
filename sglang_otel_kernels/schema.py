"""The attribute names this package writes on spans (README.md, "Span
schema"): public contracts, in one place, torch-free so the recovery tools
can use them."""

TRACER_NAME = "sglang_otel_kernels"  # the instrumentation scope of kernel spans
PREFIX = "sglang.kernel."
NAME = PREFIX + "name"
LEVEL = PREFIX + "level"
SEQ = PREFIX + "seq"
INPUT_PREFIX = PREFIX + "input."
HAS_NAN = PREFIX + "has_nan"
HAS_INF = PREFIX + "has_inf"
NONFINITE = PREFIX + "nonfinite"
ATTRIBUTES_DROPPED = PREFIX + "attributes_dropped"
DUMP_DIR = PREFIX + "dump_dir"  # level 10: the directory holding the call's inputs
DUMP_SKIPPED = PREFIX + "dump_skipped"  # level 10: why the call has no dump (limit, graph capture, error)
IN_FLIGHT = PREFIX + "in_flight"  # set by the reader on a span with no end record
BLACKBOX = PREFIX + "blackbox"  # set by the reader on a call the black box recorded

BATCH_SIZE = "sglang.batch.size"
BATCH_REQUEST_IDS = "sglang.batch.request_ids"
BATCH_UNTRACED = "sglang.batch.untraced_requests"
REQUEST_ID = "sglang.request.id"
