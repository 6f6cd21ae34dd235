/* The compiled recording core: the black-box / level-1 path of a decorated
 * call (record/core.py says when it is used), and the sidecar's encoding of
 * a plain kernel call's span (`counter_span`), the line a SIGTERM leaves
 * beside the trace file (`mark_sigterm`), and the NaN flags of a CPU
 * tensor (`finite_rows`): one translation unit, this file
 * including those of native/, each one job and naming its Python twin.
 *
 * `Ring` is a trace file's ring as the writer (record/tracefile.py) sees it:
 * where the next record goes, its sequence number, and how far records may
 * be copied without the writer's lock. `Recorded` is a decorated function:
 * a call that needs no more than its span (no text log, no statistics, no
 * hooks, no in-process export) writes its KERNEL_SPAN record before the
 * kernel and its COMPACT_END (or, with its result described, ATTRIBUTED_END)
 * after, here, in the layout of docs/trace-file-format.md; any other call
 * goes to the Python wrapper. From level 3 such a call's arguments are
 * described here as the Python path describes them (record/attributes.py):
 * tensors, numbers, strings and None in C, any other value by the Python
 * path's own function, called for that value alone.
 *
 * Everything here runs holding the GIL and calls no Python code between
 * reading a ring's state and storing it back, so a record is copied whole
 * with respect to every other thread. The Python writer marks a ring busy
 * (inline_end -1) while it writes past the inline limit (a lap, a record
 * that raises the high-water mark), which may release the GIL. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <marshal.h>
#include <structmember.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if PY_BIG_ENDIAN
#error "the trace file is little-endian; this core copies native integers"
#endif

#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif
#define MAX_INLINE_EXTRA 4096 /* a replay's or a call's attributes copied here; larger ones go through Python */
#define MAX_DESCRIBED_ARGS 64  /* a call with more arguments goes through Python */
#define TEXT_LIMIT 200         /* a string attribute's characters (attributes.py: REPR_LIMIT) */
#define IDENTITY_TEXT_LIMIT 64 /* a field's characters in an object's identity (values.py) */
#define MAX_CACHED_KEYS 4096   /* keyword argument names whose attribute keys are kept */
#define MAX_CACHED_DEVICES 256
#define MAX_CACHED_PLANS 1024  /* object types whose identity_plan is kept */
#define MAX_DIMS 64 /* a tensor of more dimensions is described by the Python path */
#define MAX_SEQUENCE_ITEMS 4 /* a list's or tuple's items described (values.py) */
#define MAX_DESCRIBED_OUTPUT (1 << 20) /* a result's metadata written here; larger, as the Python path encodes it */

/* One translation unit, in files by job (what the compiler inlines across
 * them is as it was in one file): */
#include "native/format.h"
#include "native/crc.c"
#include "native/ring.c"
#include "native/in_flight.c"
#include "native/state.c"
#include "native/describe.c"
#include "native/recorded.c"
#include "native/batch_spans.c"
#include "native/call.c"
#include "native/sigterm.c"
#include "native/otlp.c"
#include "native/finite.c"
#include "native/module.c"
