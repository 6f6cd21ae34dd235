"""The attribute names this package writes on spans (docs/span-schema.md):
public contracts, in one place, torch-free so the recovery tools can use them."""

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
THREAD_ID, THREAD_NAME = "thread.id", "thread.name"  # OpenTelemetry's: the archive of a back end names threads
IN_FLIGHT = PREFIX + "in_flight"  # set by the reader on a span with no end record
HUNG = PREFIX + "hung"  # the sidecar's early export of a call in flight longer than SGLANG_KERNEL_API_HANG_SECONDS
IN_FLIGHT_SECONDS = PREFIX + "in_flight_seconds"  # how long that call had been running then
# On a call in flight when its process died (the sidecar's export): the fatal signal the process recorded
# (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL), or "none": killed from outside (SIGKILL) or the machine went down.
FATAL_SIGNAL = "sglang.process.fatal_signal"
# A process told to stop on purpose (a serving engine's shutdown request, the SIGTERM or SIGQUIT its
# own handler took): a span of this name, at that moment, saying why in STOP_REASON. Its file then
# reads "stopped", whether the process went on to exit or was killed by its parent while stopping.
STOP_SPAN = "sglang.process.stop"
STOP_REASON = "sglang.process.stop_reason"
# An exception no code caught ended a thread (sys.excepthook, threading.excepthook): a span of this name at
# that moment, status ERROR, with the `exception` event and THREAD_NAME; a root span unless the thread had one
# current. A device error raised by a synchronisation after the call whose kernel caused it lands here.
EXCEPTION_SPAN = "sglang.process.exception"
# A process that died with nothing in flight (killed idle: the OOM killer, a kill -9): a span of this name
# the sidecar sends at its last sign of life, status ERROR, with FATAL_SIGNAL, so what a back end holds
# (Jaeger, an archive) says "died" as the file does, not "ended".
DEATH_SPAN = "sglang.process.death"
BLACKBOX = PREFIX + "blackbox"  # set by the reader on a call the black box recorded
# A batched call that matters (failed, in flight at a death, hung, NaN/Inf out),
# copied into a request trace of its batch: `<trace id>:<span id>` of the original.
COPY_OF = PREFIX + "copy_of"
NONFINITE_REQUESTS = PREFIX + "nonfinite_requests"  # level 5 and the NaN flags: the requests whose output rows hold NaN/Inf
# The NaN flags (SGLANG_KERNEL_API_NAN_FLAGS): on the first call of a step whose outputs' device-side flags
# said NaN/Inf (NaN and Inf are not told apart), written after its end, or by the reader from the
# `.nanflags` file a crash left: true.
NONFINITE_FLAG = PREFIX + "nonfinite_flag"
# Beside it, where the call's arguments were flagged too (SGLANG_KERNEL_API_NAN_FLAGS_INPUTS): true; its
# NONFINITE then names those that held NaN/Inf ("input.arg1") beside "output", as level 5 does: none named,
# it made NaN/Inf out of finite inputs; one named, it came in from before the call.
NONFINITE_INPUTS_CHECKED = PREFIX + "nonfinite_inputs_checked"
# The NaN flags' mark of that call where back ends see it: a span of this name, a child of the flagged call,
# and one in the trace of each request its flagged rows belong to (under `<batch>.request`), with
# NONFINITE_FLAG, NONFINITE_CALL (the call's name) and NONFINITE_REQUESTS.
NONFINITE_SPAN = "sglang.kernel.nonfinite"
NONFINITE_CALL = PREFIX + "nonfinite_call"
# On the NaN flags' mark in a request's trace: its row of the logits it was sampled from held NaN/Inf
# (SGLang's sampler, before SGLANG_SANITIZE_NAN_LOGITS turns them into numbers): served from non-finite logits.
NONFINITE_LOGITS = "sglang.request.nonfinite_logits"
# A call that failed on its inputs, in a batch whose rows map to requests (describe/culprits.py): the
# requests whose rows hold the bad input, and what was wrong with it; on a copy, whether its request is one.
CULPRIT_REQUESTS = PREFIX + "culprit_requests"
CULPRIT = PREFIX + "culprit"
REQUEST_CULPRIT = "sglang.request.culprit"
MODULE = PREFIX + "module"  # the model's module a call runs for, where it knows it: "model.layers.1.mlp.down_proj"
OP_CLASS = PREFIX + "op_class"  # the op's class where one recorded method serves many: "RMSNorm", "SiluAndMul"

# A collective or point-to-point op (capture/collectives.py), at every level.
COLLECTIVE = "sglang.collective."
COLLECTIVE_OP = COLLECTIVE + "op"  # all_reduce, send, ...
COLLECTIVE_GROUP = COLLECTIVE + "group"  # the group's description or name
COLLECTIVE_GROUP_RANKS = COLLECTIVE + "group_ranks"  # its members' global ranks
COLLECTIVE_SEQ = COLLECTIVE + "seq"  # per group (per peer and direction for send/recv), from 1
COLLECTIVE_ASYNC = COLLECTIVE + "async_op"
COLLECTIVE_INPUT_SHAPES = COLLECTIVE + "input_shapes"
COLLECTIVE_INPUT_DTYPES = COLLECTIVE + "input_dtypes"
COLLECTIVE_OUTPUT_SHAPES = COLLECTIVE + "output_shapes"
COLLECTIVE_OUTPUT_DTYPES = COLLECTIVE + "output_dtypes"
COLLECTIVE_REDUCE_OP = COLLECTIVE + "reduce_op"
COLLECTIVE_PEER = COLLECTIVE + "peer"  # send/recv: the other rank (global); "any" for a recv from any source
COLLECTIVE_ROOT = COLLECTIVE + "root"  # broadcast, reduce: the source or destination (global)
COLLECTIVE_TAG = COLLECTIVE + "tag"  # send/recv: the tag, when not 0
# Their order in a trace file's record (record/tracefile.py, PACKED_COLLECTIVE).
COLLECTIVE_FIELDS = (COLLECTIVE_OP, COLLECTIVE_GROUP, COLLECTIVE_GROUP_RANKS, COLLECTIVE_SEQ, COLLECTIVE_ASYNC,
                     COLLECTIVE_INPUT_SHAPES, COLLECTIVE_INPUT_DTYPES, COLLECTIVE_OUTPUT_SHAPES,
                     COLLECTIVE_OUTPUT_DTYPES, COLLECTIVE_REDUCE_OP, COLLECTIVE_PEER, COLLECTIVE_ROOT, COLLECTIVE_TAG)
SENDS = ("send", "isend")
RECVS = ("recv", "irecv")

# CUDA graphs (capture/graphs.py).
REPLAY_NAME = "cuda_graph.replay"  # the span of one CUDAGraph.replay()
GRAPH_ID = "sglang.cuda_graph.id"  # on a replay and on each call captured into the graph
GRAPH_POSITION = "sglang.cuda_graph.position"  # a captured call's place in its graph, from 1
GRAPH_CALLS = "sglang.cuda_graph.calls"  # on a replay: how many calls the graph captured
GRAPH_REPLAY = "sglang.cuda_graph.replay"  # on a replay: its number among the graph's replays, from 1
GRAPH_CAPTURED = "sglang.cuda_graph.captured"  # on a replay in flight: its graph's calls, "name (shapes)"
GRAPH_FIRST_NONFINITE = "sglang.cuda_graph.first_nonfinite"  # on a replay (the NaN check): "3: sglang.custom_op.rmsnorm", its first captured call that made NaN/Inf (or was fed it)
GRAPH_SUSPECT = "sglang.cuda_graph.suspect"  # on a call that met a device error: "graph 3, replay 17", the newest replay before
# On the call or replay in flight when a CUDA core dump of its process records a device fault (recover/device_faults.py).
CUDA_EXCEPTION = "sglang.cuda.exception"  # CUDBGException_t less its prefix: WARP_ILLEGAL_ADDRESS, WARP_ASSERT, ...
CUDA_KERNEL = "sglang.cuda.kernel"  # the faulting kernel, demangled where c++filt is
FORWARD_MODE = "sglang.forward_mode"  # the SGLang integration: DECODE, EXTEND, ...

BATCH_SIZE = "sglang.batch.size"
BATCH_REQUEST_IDS = "sglang.batch.request_ids"
BATCH_UNTRACED = "sglang.batch.untraced_requests"
BATCH_KERNEL_CALLS = "sglang.batch.kernel_calls"  # on a batch and its `<batch>.request` spans, at their end
REQUEST_ID = "sglang.request.id"
# A serving engine's stage outside its batches ("init": a scheduler's start, SGLang's Scheduler.__init__,
# where a rank that cannot start fails): a failure in it, or a death during it, is reported like a batch's.
STAGE = "sglang.engine.stage"
