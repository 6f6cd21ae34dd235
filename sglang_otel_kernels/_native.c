/* The compiled recording core: the black-box / level-1 path of a decorated
 * call (record/core.py says when it is used), and the sidecar's encoding of
 * a plain kernel call's span (`counter_span`), and the line a SIGTERM leaves
 * beside the trace file (`mark_sigterm`), at the end.
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

#define RECORD_MAGIC 0x524B4F53u
#define RECORD_HEADER_SIZE 24
#define ENCODING_COMPACT_END 1
#define ENCODING_KERNEL_SPAN 5
#define ENCODING_ATTRIBUTED_END 6
#define KERNEL_SPAN_SIZE 63 /* <QQQQqQIBBQB */
#define COMPACT_END_SIZE 17 /* <QqB */
#define FLAG_SAMPLED 1
#define FLAG_PARENT_SAMPLED 8
#define FLAG_GRAPH_REPLAY 128
#define MARSHAL_VERSION 4
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

/* -- CRC-32 (zlib's polynomial), slicing by 8 ----------------------------- */

static uint32_t crc_table[8][256];
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CRC_FOLDS 1
static int crc_clmul; /* the CPU multiplies without carries (crc_folded) */
#endif

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++)
            crc_table[t][n] = crc_table[0][crc_table[t - 1][n] & 0xFF] ^ (crc_table[t - 1][n] >> 8);
#ifdef CRC_FOLDS
    __builtin_cpu_init();
    crc_clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
}

/* Where the CPU multiplies without carries (x86-64's PCLMULQDQ), the bulk of
 * a record is folded 64 bytes a step with the constants of zlib's polynomial
 * (x^k mod P for the fold distances, and Barrett's reduction at the end), as
 * in Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ";
 * a level-3 record (several hundred bytes) then costs tens of nanoseconds,
 * not a third of the call. The register is zlib's, uninverted, in and out. */
#ifdef CRC_FOLDS
#include <immintrin.h>

__attribute__((target("pclmul,sse4.1"))) static inline __m128i crc_fold16(__m128i x, __m128i k, __m128i data) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), data);
}

/* n: at least 64, a multiple of 16. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_folded(uint32_t c, const unsigned char *p, size_t n) {
    const __m128i by64 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4), by16 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
    const __m128i by4 = _mm_set_epi64x(0, 0x163cd6124), barrett = _mm_set_epi64x(0x1f7011641, 0x1db710641);
    const __m128i low32 = _mm_set_epi32(0, 0, 0, -1);
    __m128i x1 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)c));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 16)), x3 = _mm_loadu_si128((const __m128i *)(p + 32)),
            x4 = _mm_loadu_si128((const __m128i *)(p + 48));
    for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
        x1 = crc_fold16(x1, by64, _mm_loadu_si128((const __m128i *)p));
        x2 = crc_fold16(x2, by64, _mm_loadu_si128((const __m128i *)(p + 16)));
        x3 = crc_fold16(x3, by64, _mm_loadu_si128((const __m128i *)(p + 32)));
        x4 = crc_fold16(x4, by64, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    x1 = crc_fold16(crc_fold16(crc_fold16(x1, by16, x2), by16, x3), by16, x4);
    for (; n >= 16; p += 16, n -= 16)
        x1 = crc_fold16(x1, by16, _mm_loadu_si128((const __m128i *)p));
    /* 128 bits to 64, to 32, then Barrett's reduction to the remainder */
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), _mm_clmulepi64_si128(x1, by16, 0x10));
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 4), _mm_clmulepi64_si128(_mm_and_si128(x1, low32), by4, 0x00));
    __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x1, low32), barrett, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), barrett, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(x1, t), 1);
}
#endif

static uint32_t crc32_of(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
#ifdef CRC_FOLDS
    if (crc_clmul && n >= 64) {
        c = crc_folded(c, p, n & ~(size_t)15);
        p += n & ~(size_t)15;
        n &= 15;
    }
#endif
    while (n >= 8) {
        uint32_t one, two;
        memcpy(&one, p, 4);
        memcpy(&two, p + 4, 4);
        one ^= c;
        c = crc_table[7][one & 0xFF] ^ crc_table[6][(one >> 8) & 0xFF] ^ crc_table[5][(one >> 16) & 0xFF] ^
            crc_table[4][one >> 24] ^ crc_table[3][two & 0xFF] ^ crc_table[2][(two >> 8) & 0xFF] ^
            crc_table[1][(two >> 16) & 0xFF] ^ crc_table[0][two >> 24];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* -- Ring ------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    Py_buffer view; /* the ring's bytes, while attached */
    int attached;
    long long offset;     /* where the next record goes */
    unsigned long long sequence; /* the last record's number */
    long long inline_end; /* a record may end up to here without the lock; -1: none may */
    unsigned long long id; /* tells rings apart for the symbols Recorded caches */
} Ring;

static unsigned long long ring_ids;

static int ring_init(Ring *self, PyObject *args, PyObject *kwds) {
    if (!PyArg_ParseTuple(args, ":Ring"))
        return -1;
    self->offset = 0;
    self->sequence = 0;
    self->inline_end = -1;
    self->id = ++ring_ids;
    return 0;
}

static void ring_release(Ring *self) {
    if (self->attached) {
        self->attached = 0;
        PyBuffer_Release(&self->view);
    }
    self->inline_end = -1;
}

static void ring_dealloc(Ring *self) {
    ring_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *ring_attach(Ring *self, PyObject *buffer) {
    ring_release(self);
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    self->attached = 1;
    self->id = ++ring_ids;
    Py_RETURN_NONE;
}

static PyObject *ring_detach(Ring *self, PyObject *unused) {
    ring_release(self);
    Py_RETURN_NONE;
}

/* Frames one record and copies it in when it ends within inline_end: 1, or 0
 * (nothing changed) when the writer must take its locked path. */
static int ring_copy(Ring *ring, unsigned encoding, const unsigned char *payload, size_t length) {
    long long offset = ring->offset;
    long long end = offset + (long long)((RECORD_HEADER_SIZE + length + 7) & ~(size_t)7);
    if (!ring->attached || end > ring->inline_end || end > ring->view.len)
        return 0;
    unsigned long long sequence = ring->sequence + 1;
    unsigned char *at = (unsigned char *)ring->view.buf + offset;
    uint32_t head[2] = {RECORD_MAGIC, (uint32_t)length};
    uint32_t tail[2] = {crc32_of(payload, length), encoding};
    memcpy(at, head, 8);
    memcpy(at + 8, &sequence, 8);
    memcpy(at + 16, tail, 8);
    memcpy(at + RECORD_HEADER_SIZE, payload, length);
    ring->sequence = sequence;
    ring->offset = end;
    return 1;
}

static PyObject *ring_write(Ring *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "write(encoding, payload)");
        return NULL;
    }
    long encoding = PyLong_AsLong(args[0]);
    if (encoding == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer payload;
    if (PyObject_GetBuffer(args[1], &payload, PyBUF_SIMPLE) < 0)
        return NULL;
    int done = ring_copy(self, (unsigned)encoding, payload.buf, (size_t)payload.len);
    PyBuffer_Release(&payload);
    return PyBool_FromLong(done);
}

static PyMethodDef ring_methods[] = {
    {"attach", (PyCFunction)ring_attach, METH_O, "Writes into this buffer (the ring's part of the mapping) from now on."},
    {"detach", (PyCFunction)ring_detach, METH_NOARGS, "Lets the buffer go; no record is copied inline until attach."},
    {"write", (PyCFunction)(void (*)(void))ring_write, METH_FASTCALL,
     "write(encoding, payload) -> bool: the record copied in, or False when it does not end within inline_end."},
    {NULL}};

static PyMemberDef ring_members[] = {
    {"offset", T_LONGLONG, offsetof(Ring, offset), 0, "where the next record goes"},
    {"sequence", T_ULONGLONG, offsetof(Ring, sequence), 0, "the last record's sequence number"},
    {"inline_end", T_LONGLONG, offsetof(Ring, inline_end), 0, "how far a record may end without the lock (-1: none)"},
    {NULL}};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sglang_otel_kernels._native.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A trace file's ring: its write position, sequence and inline limit.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ring_init,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_methods = ring_methods,
    .tp_members = ring_members,
};

/* -- a call in flight ----------------------------------------------------- */

/* A call this core records, as the Python side reads it while the call runs
 * (record/spans.py: TRACE_ID ... CALL_SEQ, by index or unpacked): its ints
 * kept as C fields and made into Python ints only when read. Python's tuple
 * of eleven cost a tuple and five ints made and freed every call; this one
 * is reused by the next call when nothing else kept it. */
typedef struct {
    PyObject_HEAD
    PyObject *trace, *outer, *writer, *name, *state; /* NULL once released */
    uint64_t span_id, parent_id, seq;
    long long start;
    unsigned flags;
} InFlight;

#define IN_FLIGHT_FIELDS 11

static PyObject *in_flight_item(InFlight *self, Py_ssize_t i) {
    PyObject *object;
    switch (i) {
    case 0: object = self->trace; break;
    case 1: return PyLong_FromUnsignedLongLong(self->span_id);
    case 2: return PyLong_FromUnsignedLong(self->flags);
    case 3: return PyLong_FromLongLong(self->start);
    case 4: object = self->outer; break;
    case 5: object = self->writer; break;
    case 6: object = self->name; break;
    case 7: return PyLong_FromUnsignedLongLong(self->parent_id);
    case 8: object = Py_None; break; /* no attributes: this core records calls no processor takes */
    case 9: object = self->state; break;
    case 10: return PyLong_FromUnsignedLongLong(self->seq);
    default:
        PyErr_Format(PyExc_IndexError, "a call in flight has %d fields", IN_FLIGHT_FIELDS);
        return NULL;
    }
    return Py_NewRef(object != NULL ? object : Py_None);
}

static Py_ssize_t in_flight_length(PyObject *self) { return IN_FLIGHT_FIELDS; }

static int in_flight_traverse(InFlight *self, visitproc visit, void *arg) {
    Py_VISIT(self->trace);
    Py_VISIT(self->outer);
    Py_VISIT(self->writer);
    Py_VISIT(self->name);
    Py_VISIT(self->state);
    return 0;
}

static int in_flight_clear(InFlight *self) {
    Py_CLEAR(self->trace);
    Py_CLEAR(self->outer);
    Py_CLEAR(self->writer);
    Py_CLEAR(self->name);
    Py_CLEAR(self->state);
    return 0;
}

static void in_flight_dealloc(InFlight *self) {
    PyObject_GC_UnTrack(self);
    in_flight_clear(self);
    PyObject_GC_Del(self);
}

static PyObject *in_flight_repr(InFlight *self) {
    return PyUnicode_FromFormat("<call %R in flight, number %llu>", self->name ? self->name : Py_None,
                                (unsigned long long)self->seq);
}

static PySequenceMethods in_flight_sequence = {
    .sq_length = in_flight_length,
    .sq_item = (ssizeargfunc)in_flight_item,
};

static PyTypeObject InFlightType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sglang_otel_kernels._native.InFlight",
    .tp_basicsize = sizeof(InFlight),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A kernel call the compiled core records, while it runs: read like record/spans.py's tuple.",
    .tp_dealloc = (destructor)in_flight_dealloc,
    .tp_traverse = (traverseproc)in_flight_traverse,
    .tp_clear = (inquiry)in_flight_clear,
    .tp_as_sequence = &in_flight_sequence,
    .tp_repr = (reprfunc)in_flight_repr,
};

static InFlight *spare_in_flight; /* one ended call nothing else held, for the next */

/* An InFlight to fill (its references NULL): the spare, or a new one. */
static InFlight *in_flight_new(void) {
    InFlight *call = spare_in_flight;
    if (call != NULL) {
        spare_in_flight = NULL;
        return call;
    }
    call = PyObject_GC_New(InFlight, &InFlightType);
    if (call == NULL)
        return NULL;
    call->trace = call->outer = call->writer = call->name = call->state = NULL;
    PyObject_GC_Track(call);
    return call;
}

/* The ended call given back: kept as the spare when this was its last
 * reference (nothing Python kept can see it change), else released. */
static void in_flight_done(InFlight *call) {
    if (Py_REFCNT(call) == 1 && spare_in_flight == NULL) {
        in_flight_clear(call); /* may run finalizers: the spare is taken only after */
        if (Py_REFCNT(call) == 1 && spare_in_flight == NULL) {
            spare_in_flight = call;
            return;
        }
    }
    Py_DECREF(call);
}

/* -- what the Python side sets ------------------------------------------- */

static struct {
    PyObject *writer;     /* the current TraceFileWriter, or NULL */
    Ring *ring;           /* its Ring */
    PyObject *spans;      /* the runtime's KernelSpans, or NULL */
    int spans_ready;      /* 0: not known yet; 1: set up, no processor to hand calls to;
                             2: set up with the provider's processors, `processors` */
    PyObject *processors; /* spans._processors, with 2 */
    PyObject *seen;       /* its processors when found to be the trace file's alone */
    long bare_upto;       /* sites up to this level need their span alone (-1: none) */
    long described_upto;  /* sites above bare_upto up to this level need their span and their
                             arguments' metadata, described here (-1: none) */
    unsigned span_flags;  /* FLAG_BLACKBOX or 0 */
    int capturing;        /* CUDA graphs being captured */
    PyObject *per_thread; /* tracefile.per_thread */
    PyObject *context_var; /* OpenTelemetry's ContextVar, or NULL: get_current is called */
    PyObject *get_current;
    PyObject *parent_of;  /* spans._parent_of */
    PyObject *failed;     /* (site, call, exception) -> None: a call that raised */
    PyObject *compiler;   /* torch.compiler's namespace, whose _is_compiling_flag is read, or NULL */
    PyObject *is_compiling; /* else this is called */
    unsigned long long seq; /* call numbers */
    unsigned long long recorded; /* calls this core recorded itself */
    uint64_t random[4];   /* xoshiro256** */
    /* The last context a root call looked at, and what it gives (see spans._parent_of). */
    PyObject *last_context;
    PyObject *last_trace; /* its trace id as an int, or NULL: each call starts a trace */
    uint64_t trace_hi, trace_lo, parent_id;
    unsigned parent_flags;
} core = {.bare_upto = -1, .described_upto = -1};

/* What describing arguments reads (set_describer). */
static struct {
    PyObject *tensor_type, *parameter_type; /* the tensors described here: exactly these types */
    PyObject *dtype_names;                  /* dtype -> its name, as describe/tensors.py writes it */
    PyObject *strided;                      /* torch.strided: other layouts go to Python */
    PyObject *prefix;                       /* "sglang.kernel." */
    PyObject *add_described;                /* (attributes, path, value): the Python path, for one value */
    PyObject *encode;                       /* tracefile.encode, where marshal refuses */
    PyObject *arg_keys;                     /* list: positional index -> its keys (keys_of) */
    PyObject *kw_keys;                      /* dict: keyword -> its keys */
    PyObject *output_keys;
    PyObject *devices;                      /* device -> its name */
    PyObject *identity_plan;                /* describe/values.py's, asked once per object type */
    PyObject *plans;                        /* dict: type -> its plan, or None (the Python path) */
    PyObject *enum_type;                    /* enum.Enum */
} describer;

static PyObject *str_span_processors, *str_seen, *str_targets;
static PyObject *str_state, *str_provider, *str_processors, *str_symbols, *str_write_record, *str_flag, *one;
static PyObject *str_attributes, *str_numbers;
static PyObject *str_shape, *str_dtype, *str_is_cpu, *str_device, *str_layout, *str_stride,
    *str_requires_grad, *str_skip_self, *str_cpu, *str_none, *str_nan, *str_inf, *str_minus_inf, *str_name;

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t random64(void) {
    uint64_t *s = core.random;
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static PyObject *int128(uint64_t hi, uint64_t lo) {
    unsigned char bytes[16];
    memcpy(bytes, &lo, 8);
    memcpy(bytes + 8, &hi, 8);
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(bytes, 16, Py_ASNATIVEBYTES_LITTLE_ENDIAN);
#else
    return _PyLong_FromByteArray(bytes, 16, 1, 0);
#endif
}

/* An int below 2**128 as its two halves: 0, or -1 with an exception set. */
static int split128(PyObject *value, uint64_t *hi, uint64_t *lo) {
    unsigned char bytes[16];
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t n = PyLong_AsNativeBytes(value, bytes, 16,
                                        Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
    if (n < 0)
        return -1;
    if (n > 16) {
        PyErr_SetString(PyExc_OverflowError, "a trace id of more than 128 bits");
        return -1;
    }
#else
    if (!PyLong_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "a trace id is an int");
        return -1;
    }
    if (_PyLong_AsByteArray((PyLongObject *)value, bytes, 16, 1, 0) < 0)
        return -1;
#endif
    memcpy(lo, bytes, 8);
    memcpy(hi, bytes + 8, 8);
    return 0;
}

/* A new random trace id: its halves, and it as an int (NULL: an error). */
static PyObject *random_trace(uint64_t *hi, uint64_t *lo) {
    *hi = random64();
    *lo = random64();
    if (!(*hi | *lo))
        *lo = 1;
    return int128(*hi, *lo);
}

/* A new span id: never 0, which stands for none. */
static uint64_t random_span_id(void) {
    uint64_t id = random64();
    return id ? id : 1;
}

static void put_u64(unsigned char *at, uint64_t value) { memcpy(at, &value, 8); }

/* What a start record (a span's, a kernel call's) begins with: its trace id,
 * span id, parent id, start time, thread and name symbol (48 + 4 bytes). */
static void put_span_head(unsigned char *record, uint64_t hi, uint64_t lo, uint64_t span_id, uint64_t parent_id,
                          long long start, uint64_t ident, uint32_t symbol) {
    put_u64(record, hi);
    put_u64(record + 8, lo);
    put_u64(record + 16, span_id);
    put_u64(record + 24, parent_id);
    put_u64(record + 32, (uint64_t)start);
    put_u64(record + 40, ident);
    memcpy(record + 48, &symbol, 4);
}

static PyObject *set_writer(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || (args[1] != Py_None && !PyObject_TypeCheck(args[1], &RingType))) {
        PyErr_SetString(PyExc_TypeError, "set_writer(writer or None, its Ring or None)");
        return NULL;
    }
    Py_CLEAR(core.writer);
    Py_CLEAR(core.ring);
    if (args[0] != Py_None && args[1] != Py_None) {
        core.writer = Py_NewRef(args[0]);
        core.ring = (Ring *)Py_NewRef(args[1]);
    }
    Py_RETURN_NONE;
}

static PyObject *set_runtime(PyObject *module, PyObject *args) {
    PyObject *spans;
    long bare_upto, described_upto = -1;
    unsigned int flags;
    if (!PyArg_ParseTuple(args, "OlI|l:set_runtime", &spans, &bare_upto, &flags, &described_upto))
        return NULL;
    Py_CLEAR(core.spans);
    if (spans != Py_None)
        core.spans = Py_NewRef(spans);
    core.spans_ready = 0;
    Py_CLEAR(core.processors);
    Py_CLEAR(core.seen);
    core.bare_upto = spans == Py_None ? -1 : bare_upto;
    core.described_upto = spans == Py_None ? -1 : described_upto;
    core.span_flags = flags;
    Py_RETURN_NONE;
}

static PyObject *set_capturing(PyObject *module, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    core.capturing = (int)n;
    Py_RETURN_NONE;
}

/* This thread's `per_thread.state` (a new reference). Python makes the list
 * once per thread and never replaces it, so the last recording thread's is
 * kept here, keyed by its thread state's id, which the interpreter gives no
 * other thread: a thread-local read costs several hundred nanoseconds on a
 * server, where a model's step between two calls leaves it cold. */
static uint64_t state_owner;
static PyObject *state_of_owner;

static PyObject *thread_state(void) {
    uint64_t id = PyThreadState_GetID(PyThreadState_Get());
    if (id == state_owner && state_of_owner != NULL)
        return Py_NewRef(state_of_owner);
    PyObject *state = PyObject_GetAttr(core.per_thread, str_state);
    if (state != NULL) {
        Py_XSETREF(state_of_owner, Py_NewRef(state));
        state_owner = id;
    }
    return state;
}

static PyObject *setup(PyObject *module, PyObject *args) {
    PyObject *per_thread, *context_var, *get_current, *parent_of, *failed, *compiler, *is_compiling;
    if (!PyArg_ParseTuple(args, "OOOOOOO:setup", &per_thread, &context_var, &get_current, &parent_of, &failed,
                          &compiler, &is_compiling))
        return NULL;
    Py_XSETREF(core.per_thread, Py_NewRef(per_thread));
    Py_CLEAR(state_of_owner); /* another object's states */
    Py_XSETREF(core.context_var, context_var == Py_None ? NULL : Py_NewRef(context_var));
    Py_XSETREF(core.get_current, Py_NewRef(get_current));
    Py_XSETREF(core.parent_of, Py_NewRef(parent_of));
    Py_XSETREF(core.failed, Py_NewRef(failed));
    if (compiler != Py_None && !PyDict_Check(compiler)) {
        PyErr_SetString(PyExc_TypeError, "setup: torch.compiler's namespace (a dict) or None");
        return NULL;
    }
    Py_XSETREF(core.compiler, compiler == Py_None ? NULL : Py_NewRef(compiler));
    Py_XSETREF(core.is_compiling, Py_NewRef(is_compiling));
    Py_RETURN_NONE;
}

static PyObject *seed(PyObject *module, PyObject *arg) {
    Py_buffer bytes;
    if (PyObject_GetBuffer(arg, &bytes, PyBUF_SIMPLE) < 0)
        return NULL;
    if (bytes.len != sizeof(core.random)) {
        PyBuffer_Release(&bytes);
        PyErr_SetString(PyExc_ValueError, "seed takes 32 bytes");
        return NULL;
    }
    memcpy(core.random, bytes.buf, sizeof(core.random));
    PyBuffer_Release(&bytes);
    if (!(core.random[0] | core.random[1] | core.random[2] | core.random[3]))
        core.random[0] = 1;
    Py_RETURN_NONE;
}

static PyObject *next_seq(PyObject *module, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(++core.seq);
}

static PyObject *recorded(PyObject *module, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(core.recorded);
}

static PyObject *reset_seq(PyObject *module, PyObject *unused) {
    core.seq = 0;
    Py_CLEAR(core.last_context);
    Py_CLEAR(core.last_trace);
    Py_RETURN_NONE;
}

/* -- Describing arguments (level 3) ------------------------------------------ */

static PyObject *set_describer(PyObject *module, PyObject *args) {
    PyObject *tensor_type, *parameter_type, *dtype_names, *strided, *prefix, *add_described, *encode, *identity_plan,
        *enum_type;
    if (!PyArg_ParseTuple(args, "O!O!O!OUOOOO!:set_describer", &PyType_Type, &tensor_type, &PyType_Type,
                          &parameter_type, &PyDict_Type, &dtype_names, &strided, &prefix, &add_described, &encode,
                          &identity_plan, &PyType_Type, &enum_type))
        return NULL;
    if (!PyCallable_Check(add_described) || !PyCallable_Check(encode) || !PyCallable_Check(identity_plan)) {
        PyErr_SetString(PyExc_TypeError, "set_describer: add_described, encode and identity_plan are callables");
        return NULL;
    }
    PyObject *arg_keys = PyList_New(0), *kw_keys = PyDict_New(), *devices = PyDict_New(), *plans = PyDict_New();
    if (arg_keys == NULL || kw_keys == NULL || devices == NULL || plans == NULL) {
        Py_XDECREF(arg_keys);
        Py_XDECREF(kw_keys);
        Py_XDECREF(devices);
        Py_XDECREF(plans);
        return NULL;
    }
    Py_XSETREF(describer.tensor_type, Py_NewRef(tensor_type));
    Py_XSETREF(describer.parameter_type, Py_NewRef(parameter_type));
    Py_XSETREF(describer.dtype_names, Py_NewRef(dtype_names));
    Py_XSETREF(describer.strided, Py_NewRef(strided));
    Py_XSETREF(describer.prefix, Py_NewRef(prefix));
    Py_XSETREF(describer.add_described, Py_NewRef(add_described));
    Py_XSETREF(describer.encode, Py_NewRef(encode));
    Py_XSETREF(describer.arg_keys, arg_keys);
    Py_XSETREF(describer.kw_keys, kw_keys);
    Py_XSETREF(describer.devices, devices);
    Py_XSETREF(describer.identity_plan, Py_NewRef(identity_plan));
    Py_XSETREF(describer.plans, plans);
    Py_XSETREF(describer.enum_type, Py_NewRef(enum_type));
    Py_CLEAR(describer.output_keys);
    Py_RETURN_NONE;
}

/* A call's described attributes are written straight in marshal's format (a
 * dict: '{', key and value pairs, '0'), which the reader loads as it loads
 * the Python path's marshal.dumps: no dict, tuple or bytes built per value.
 * Keys are encoded once; values are the few kinds below; anything else is
 * described by the Python path's function into a scratch dict, whose
 * marshal data (version 2: no back-references, so it can be spliced) is
 * copied in without its braces. */

typedef struct {
    unsigned char *data; /* `local`, or a PyMem block once grown */
    size_t size, capacity, limit;
    unsigned char local[2048]; /* a level-3 call's record, as a rule */
} Out;

static void out_init(Out *out, size_t limit) {
    out->data = out->local;
    out->size = 0;
    out->capacity = sizeof(out->local);
    out->limit = limit;
}

static void out_free(Out *out) {
    if (out->data != out->local)
        PyMem_Free(out->data);
}

/* Room for `n` more bytes, once the buffer is full: 0, or -1 past the
 * limit (no error set) or on a MemoryError. */
static int out_grow(Out *out, size_t n) {
    if (out->size + n > out->limit)
        return -1;
    size_t capacity = out->capacity * 2 > out->size + n ? out->capacity * 2 : out->size + n;
    unsigned char *data = out->data == out->local ? PyMem_Malloc(capacity) : PyMem_Realloc(out->data, capacity);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (out->data == out->local)
        memcpy(data, out->local, out->size);
    out->data = data;
    out->capacity = capacity;
    return 0;
}

/* Inlined: most writes are a few bytes of a size known here (a type code
 * and its length), which a copy of that size writes without calling memcpy. */
static ALWAYS_INLINE int out_put(Out *out, const void *bytes, size_t n) {
    if (out->capacity - out->size < n && out_grow(out, n) < 0)
        return -1;
    memcpy(out->data + out->size, bytes, n);
    out->size += n;
    return 0;
}

static int out_type(Out *out, char type, uint32_t length) { /* a marshal type code and its 4-byte length */
    unsigned char head[5] = {(unsigned char)type};
    memcpy(head + 1, &length, 4);
    return out_put(out, head, 5);
}

static int out_int(Out *out, long long value) {
    if (value >= INT32_MIN && value <= INT32_MAX)
        return out_type(out, 'i', (uint32_t)(int32_t)value);
    /* marshal's long: a signed count of 15-bit digits, least significant first */
    unsigned long long magnitude = value < 0 ? 0ULL - (unsigned long long)value : (unsigned long long)value;
    uint16_t digits[5];
    int count = 0;
    for (; magnitude; magnitude >>= 15)
        digits[count++] = (uint16_t)(magnitude & 0x7fff);
    if (out_type(out, 'l', (uint32_t)(int32_t)(value < 0 ? -count : count)) < 0)
        return -1;
    return out_put(out, digits, 2 * (size_t)count);
}

static int out_float(Out *out, double value) {
    unsigned char item[9] = {'g'};
    memcpy(item + 1, &value, 8);
    return out_put(out, item, 9);
}

/* `n` bytes of UTF-8 (`ascii`: all ASCII) as a str. */
static int out_utf8(Out *out, const char *utf8, size_t n, int ascii, int interned) {
    if (ascii && n < 256) {
        unsigned char head[2] = {interned ? 'Z' : 'z', (unsigned char)n};
        if (out_put(out, head, 2) < 0)
            return -1;
    } else if (out_type(out, ascii ? 'a' : 'u', (uint32_t)n) < 0) {
        return -1;
    }
    return out_put(out, utf8, n);
}

/* A str whose UTF-8 can be had (else -1, with the error set). */
static int out_text(Out *out, PyObject *text, int interned) {
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &n);
    return utf8 == NULL ? -1 : out_utf8(out, utf8, (size_t)n, PyUnicode_IS_ASCII(text), interned);
}

/* A shape's or a stride's items into `values`: how many, or -1 where one
 * is not an int of 64 bits or there are more than MAX_DIMS (no error set). */
static Py_ssize_t read_ints(PyObject *tuple, long long *values) {
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    if (n > MAX_DIMS)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(tuple, i);
        values[i] = PyLong_Check(item) ? PyLong_AsLongLong(item) : -1;
        if (!PyLong_Check(item) || (values[i] == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return -1;
        }
    }
    return n;
}

/* A tuple of `n` ints: 0, or -1 past the limit. */
static int out_ints(Out *out, const long long *values, Py_ssize_t n) {
    if (n < 256) {
        unsigned char head[2] = {')', (unsigned char)n};
        if (out_put(out, head, 2) < 0)
            return -1;
    } else if (out_type(out, '(', (uint32_t)n) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (out_int(out, values[i]) < 0)
            return -1;
    return 0;
}

/* The attribute keys of a value at `path` (`input.arg0`, `output`): its own
 * and those of a tensor's fields, in the order the Python path writes them,
 * each as marshal data (bytes); then the path itself, for the Python path's
 * function; last, a list its items' keys are kept in once asked (item_keys). */
static PyObject *keys_of(PyObject *path) {
    static const char *fields[] = {"", ".shape", ".dtype", ".device", ".stride", ".contiguous", ".requires_grad"};
    PyObject *keys = PyTuple_New(9), *items = PyList_New(0);
    if (keys == NULL || items == NULL) {
        Py_XDECREF(keys);
        Py_XDECREF(items);
        return NULL;
    }
    PyTuple_SET_ITEM(keys, 8, items);
    for (int i = 0; i < 7; i++) {
        PyObject *key = PyUnicode_FromFormat("%U%U%s", describer.prefix, path, fields[i]);
        Out out;
        out_init(&out, MAX_INLINE_EXTRA);
        int done = key != NULL ? out_text(&out, key, 1) : -1;
        Py_XDECREF(key);
        PyObject *data = done == 0 ? PyBytes_FromStringAndSize((const char *)out.data, (Py_ssize_t)out.size) : NULL;
        out_free(&out);
        if (data == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "an attribute key too long");
            Py_DECREF(keys);
            return NULL;
        }
        PyTuple_SET_ITEM(keys, i, data);
    }
    PyTuple_SET_ITEM(keys, 7, Py_NewRef(path));
    return keys;
}

/* A borrowed reference to the keys of positional argument `index`. */
static PyObject *arg_keys(Py_ssize_t index) {
    while (PyList_GET_SIZE(describer.arg_keys) <= index) {
        PyObject *path = PyUnicode_FromFormat("input.arg%zd", PyList_GET_SIZE(describer.arg_keys));
        PyObject *keys = path != NULL ? keys_of(path) : NULL;
        Py_XDECREF(path);
        if (keys == NULL || PyList_Append(describer.arg_keys, keys) < 0) {
            Py_XDECREF(keys);
            return NULL;
        }
        Py_DECREF(keys);
    }
    return PyList_GET_ITEM(describer.arg_keys, index);
}

/* A borrowed reference to the keys of item `index` of the value at `keys`. */
static PyObject *item_keys(PyObject *keys, Py_ssize_t index) {
    PyObject *items = PyTuple_GET_ITEM(keys, 8);
    while (PyList_GET_SIZE(items) <= index) {
        PyObject *path = PyUnicode_FromFormat("%U.%zd", PyTuple_GET_ITEM(keys, 7), PyList_GET_SIZE(items));
        PyObject *item = path != NULL ? keys_of(path) : NULL;
        Py_XDECREF(path);
        if (item == NULL || PyList_Append(items, item) < 0) {
            Py_XDECREF(item);
            return NULL;
        }
        Py_DECREF(item);
    }
    return PyList_GET_ITEM(items, index);
}

/* The keys of keyword argument `name`: a new reference. */
static PyObject *kw_keys(PyObject *name) {
    PyObject *keys = PyDict_GetItemWithError(describer.kw_keys, name);
    if (keys != NULL)
        return Py_NewRef(keys);
    if (PyErr_Occurred())
        return NULL;
    PyObject *path = PyUnicode_FromFormat("input.%U", name);
    keys = path != NULL ? keys_of(path) : NULL;
    Py_XDECREF(path);
    /* Keyword names repeat from call to call; a bound all the same. */
    if (keys != NULL && PyDict_GET_SIZE(describer.kw_keys) < MAX_CACHED_KEYS &&
        PyDict_SetItem(describer.kw_keys, name, keys) < 0)
        Py_CLEAR(keys);
    return keys;
}

static int out_key(Out *out, PyObject *keys, int field) {
    PyObject *key = PyTuple_GET_ITEM(keys, field);
    return out_put(out, PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key));
}

/* A device's name, as describe/tensors.py gives it: "cpu", else str(device). */
static PyObject *device_name(PyObject *tensor) {
    PyObject *is_cpu = PyObject_GetAttr(tensor, str_is_cpu);
    if (is_cpu == NULL)
        return NULL;
    Py_DECREF(is_cpu);
    if (is_cpu == Py_True)
        return Py_NewRef(str_cpu);
    PyObject *device = PyObject_GetAttr(tensor, str_device);
    if (device == NULL)
        return NULL;
    PyObject *name = PyDict_GetItemWithError(describer.devices, device);
    if (name != NULL) {
        Py_DECREF(device);
        return Py_NewRef(name);
    }
    if (PyErr_Occurred() || (name = PyObject_Str(device)) == NULL) {
        Py_DECREF(device);
        return NULL;
    }
    if (PyDict_GET_SIZE(describer.devices) < MAX_CACHED_DEVICES && PyDict_SetItem(describer.devices, device, name) < 0)
        Py_CLEAR(name);
    Py_DECREF(device);
    return name;
}

/* Whether a strided tensor of this shape and stride is contiguous, as
 * TensorImpl computes it for is_contiguous(): dims of size 1 are skipped,
 * an empty tensor is contiguous. */
static int contiguous(const long long *shape, const long long *stride, Py_ssize_t n) {
    unsigned long long expected = 1;
    int answer = 1;
    for (Py_ssize_t d = n - 1; d >= 0; d--) {
        if (shape[d] == 0)
            return 1;
        if (shape[d] != 1 && answer) {
            if ((unsigned long long)stride[d] == expected)
                expected *= (unsigned long long)shape[d];
            else
                answer = 0;
        }
    }
    return answer;
}

/* A plain tensor's fields: 1 when written, 0 (nothing written, no error
 * set) for one the Python path describes (another layout, a dtype not
 * known here, a field that cannot be read), -1 past the limit or on an error to raise. */
static int out_tensor(Out *out, PyObject *keys, PyObject *tensor) {
    long long shape[MAX_DIMS], stride[MAX_DIMS];
    Py_ssize_t dims = -1, strides = -1;
    PyObject *layout = PyObject_GetAttr(tensor, str_layout);
    int plain = layout == describer.strided;
    Py_XDECREF(layout);
    PyObject *sizes = plain ? PyObject_GetAttr(tensor, str_shape) : NULL;
    if (sizes != NULL && PyTuple_Check(sizes))
        dims = read_ints(sizes, shape);
    Py_XDECREF(sizes);
    PyObject *dtype = dims >= 0 ? PyObject_GetAttr(tensor, str_dtype) : NULL;
    PyObject *dtype_name = dtype != NULL ? PyDict_GetItemWithError(describer.dtype_names, dtype) : NULL;
    Py_XDECREF(dtype);
    PyObject *device = dtype_name != NULL ? device_name(tensor) : NULL;
    PyObject *steps = device != NULL ? PyObject_CallMethodNoArgs(tensor, str_stride) : NULL;
    if (steps != NULL && PyTuple_Check(steps))
        strides = read_ints(steps, stride);
    Py_XDECREF(steps);
    PyObject *requires_grad = strides == dims && dims >= 0 ? PyObject_GetAttr(tensor, str_requires_grad) : NULL;
    int done = 0;
    if (requires_grad != NULL && PyUnicode_Check(dtype_name) && PyUnicode_Check(device))
        done = out_key(out, keys, 1) < 0 || out_ints(out, shape, dims) < 0 || out_key(out, keys, 2) < 0 ||
                       out_text(out, dtype_name, 0) < 0 || out_key(out, keys, 3) < 0 || out_text(out, device, 0) < 0 ||
                       out_key(out, keys, 4) < 0 || out_ints(out, stride, dims) < 0 || out_key(out, keys, 5) < 0 ||
                       out_put(out, contiguous(shape, stride, dims) ? "T" : "F", 1) < 0 || out_key(out, keys, 6) < 0 ||
                       out_put(out, requires_grad == Py_True ? "T" : "F", 1) < 0
                   ? -1
                   : 1;
    Py_XDECREF(device);
    Py_XDECREF(requires_grad);
    if (done == 0 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return -1;
        PyErr_Clear();
    }
    return done;
}

/* An object's plan (describe/values.py's identity_plan), borrowed: a
 * tuple, Py_None, or NULL with an error set. Kept once given, for as many
 * types as are kept; past that, Py_None. */
static PyObject *plan_of(PyObject *value) {
    PyObject *type = (PyObject *)Py_TYPE(value);
    PyObject *plan = PyDict_GetItemWithError(describer.plans, type);
    if (plan != NULL || PyErr_Occurred())
        return plan;
    if (PyDict_GET_SIZE(describer.plans) >= MAX_CACHED_PLANS)
        return Py_None;
    plan = PyObject_CallOneArg(describer.identity_plan, value);
    if (plan == NULL || plan == Py_False) { /* False: not yet, asked again with the next instance */
        Py_XDECREF(plan);
        return plan == NULL ? NULL : Py_None;
    }
    if (plan != Py_None && !(PyTuple_CheckExact(plan) && PyTuple_GET_SIZE(plan) == 4 &&
                             PyUnicode_CheckExact(PyTuple_GET_ITEM(plan, 0)) && PyTuple_CheckExact(PyTuple_GET_ITEM(plan, 1)) &&
                             PyTuple_CheckExact(PyTuple_GET_ITEM(plan, 2)) && PyTuple_CheckExact(PyTuple_GET_ITEM(plan, 3))))
        Py_SETREF(plan, Py_NewRef(Py_None));
    int stored = PyDict_SetItem(describer.plans, type, plan);
    Py_DECREF(plan);
    return stored < 0 ? NULL : PyDict_GetItemWithError(describer.plans, type);
}

/* Whether `names` holds a key of `dict` (1, 0; -1 with an error set). */
static int holds_any(PyObject *dict, PyObject *names) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names) && PyDict_GET_SIZE(dict) > 0; i++) {
        int found = PyDict_Contains(dict, PyTuple_GET_ITEM(names, i));
        if (found != 0)
            return found;
    }
    return 0;
}

/* `value` in decimal, written backwards from `end` (room for 20 bytes before it): where it begins. */
static char *decimal(char *end, long long value) {
    unsigned long long magnitude = value < 0 ? 0ULL - (unsigned long long)value : (unsigned long long)value;
    do
        *--end = (char)('0' + magnitude % 10);
    while (magnitude /= 10);
    if (value < 0)
        *--end = '-';
    return end;
}

/* An identity's text, built in place as UTF-8 and cut at TEXT_LIMIT
 * characters, as record/attributes.py's _text cuts a text. */
typedef struct {
    char data[4 * TEXT_LIMIT];
    size_t size;
    Py_ssize_t chars;
    int ascii;
} Text;

/* Appends the first `limit` characters of `n` bytes of UTF-8, or as many of them as fit. */
static void text_put(Text *text, const char *utf8, size_t n, Py_ssize_t limit) {
    size_t end = 0;
    for (Py_ssize_t c = 0; end < n && c < limit && text->chars < TEXT_LIMIT; c++, text->chars++)
        if ((unsigned char)utf8[end++] >= 0x80) {
            text->ascii = 0;
            while (end < n && ((unsigned char)utf8[end] & 0xC0) == 0x80)
                end++;
        }
    memcpy(text->data + text->size, utf8, end);
    text->size += end;
}

/* A str's first `limit` characters: 0, or -1 with an error set (a lone
 * surrogate, whose text the Python path mends). */
static int text_put_str(Text *text, PyObject *str, Py_ssize_t limit) {
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(str, &n);
    if (utf8 == NULL)
        return -1;
    text_put(text, utf8, (size_t)n, limit);
    return 0;
}

/* `name=text` for a field, as describe/values.py's identity writes one
 * (its text as _field_text writes it), after `(` or `, `: 1 written, 0
 * where it writes none, -1 with an error set where the Python path must
 * write the value (an enum's name that is no exact str, or an error). */
static int text_field(Text *text, PyObject *name, PyObject *field, int first) {
    PyTypeObject *type = Py_TYPE(field);
    PyObject *owned = NULL; /* the text as a str, where it is not written from `utf8` alone */
    char number[32];
    const char *utf8 = NULL;
    Py_ssize_t size = 0, limit = TEXT_LIMIT;
    if (type == &PyBool_Type) {
        utf8 = field == Py_True ? "True" : "False";
        size = (Py_ssize_t)strlen(utf8);
    } else if (type == &PyLong_Type) {
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(field, &overflow);
        if (value == -1 && PyErr_Occurred())
            return -1;
        if (overflow) {
            owned = PyObject_Repr(field);
        } else {
            utf8 = decimal(number + sizeof(number), value);
            size = number + sizeof(number) - utf8;
        }
    } else if (type == &PyFloat_Type) {
        owned = PyObject_Repr(field);
    } else if (type == &PyUnicode_Type) {
        owned = Py_NewRef(field);
        limit = IDENTITY_TEXT_LIMIT;
    } else if (field == Py_None) {
        return 0;
    } else {
        int is_enum = PyType_IsSubtype(type, (PyTypeObject *)describer.enum_type) ||
                      PyObject_IsInstance(field, describer.enum_type); /* (one whose __class__ says so) */
        if (is_enum <= 0)
            return is_enum;
        owned = PyObject_GetAttr(field, str_name);
        if (owned != NULL && !PyUnicode_CheckExact(owned)) {
            Py_DECREF(owned);
            PyErr_SetString(PyExc_TypeError, "an enum member's name that is not a plain str");
            return -1;
        }
    }
    /* the value's UTF-8 first: nothing of the field written where it fails */
    if (utf8 == NULL && (owned == NULL || (utf8 = PyUnicode_AsUTF8AndSize(owned, &size)) == NULL)) {
        Py_XDECREF(owned);
        return -1;
    }
    text_put(text, first ? "(" : ", ", first ? 1 : 2, 2);
    text_put_str(text, name, TEXT_LIMIT); /* an IDENTITY_FIELDS name: ASCII */
    text_put(text, "=", 1, 1);
    text_put(text, utf8, (size_t)size, limit);
    Py_XDECREF(owned);
    return 1;
}

/* What identifies an object, by its type's plan, written at `keys`:
 * `Type(field=text, ...)` from its instance dict, as describe/values.py's
 * identity writes it, cut as record/attributes.py's _text cuts it. 0, -1
 * past the limit or on an error to raise, -2 (nothing written) for the
 * Python path: no plan, fields it shows instead, a text it mends. */
static int out_identity(Out *out, PyObject *keys, PyObject *value) {
    PyObject *plan = Py_XNewRef(plan_of(value)); /* held: reading fields may run Python code */
    int python = plan == NULL || plan == Py_None;
    PyObject *own = !python ? PyObject_GenericGetDict(value, NULL) : NULL;
    Text text = {.size = 0, .chars = 0, .ascii = 1};
    int fields = 0;
    if (!python) { /* its fields, or an error: the Python path */
        PyObject *names = PyTuple_GET_ITEM(plan, 1), *absent = PyTuple_GET_ITEM(plan, 2), *inner = PyTuple_GET_ITEM(plan, 3);
        python = own == NULL || !PyDict_CheckExact(own) || holds_any(own, absent) != 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(inner) && !python; i++) {
            PyObject *searched = Py_XNewRef(PyDict_GetItemWithError(own, PyTuple_GET_ITEM(inner, i)));
            python = searched != NULL ? !PyDict_CheckExact(searched) || holds_any(searched, absent) != 0 : PyErr_Occurred() != NULL;
            Py_XDECREF(searched);
        }
        python = python || text_put_str(&text, PyTuple_GET_ITEM(plan, 0), TEXT_LIMIT) < 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names) && !python; i++) {
            PyObject *name = PyTuple_GET_ITEM(names, i);
            PyObject *field = Py_XNewRef(PyDict_GetItemWithError(own, name));
            int written = field != NULL ? text_field(&text, name, field, fields == 0) : PyErr_Occurred() ? -1 : 0;
            Py_XDECREF(field);
            python = written < 0;
            fields += written > 0;
        }
    }
    Py_XDECREF(own);
    Py_XDECREF(plan);
    if (python) { /* what failed here, the Python path's own guards meet */
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception))
            return -1;
        PyErr_Clear();
        return -2;
    }
    if (fields)
        text_put(&text, ")", 1, 1);
    return out_key(out, keys, 0) < 0 || out_utf8(out, text.data, text.size, text.ascii, 0) < 0 ? -1 : 0;
}

/* The key at field 0 of `keys` and `text` as its value: 0, -1 past the
 * limit or on an error to raise, -2 (nothing written) for a text with a lone
 * surrogate, which the Python path mends. */
static int out_keyed_text(Out *out, PyObject *keys, PyObject *text) {
    size_t mark = out->size;
    int done = out_key(out, keys, 0) < 0 ? -1 : out_text(out, text, 0);
    if (done < 0 && PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_UnicodeError)) {
        PyErr_Clear();
        out->size = mark;
        return -2;
    }
    return done;
}

/* A dict's key and value pairs in marshal's format (version 2: no
 * back-references, so they can be spliced into another dict's): a new
 * bytes object, or NULL with an error set. */
static PyObject *dict_pairs(PyObject *dict) {
    PyObject *data = PyMarshal_WriteObjectToString(dict, 2);
    if (data == NULL)
        return NULL;
    /* '{', its pairs, '0': the pairs alone */
    Py_SETREF(data, PyBytes_FromStringAndSize(PyBytes_AS_STRING(data) + 1, PyBytes_GET_SIZE(data) - 2));
    return data;
}

/* `value` at the path of `keys` described by the Python path's own
 * function: a new dict of its attributes, or NULL with an error set. */
static PyObject *python_described(PyObject *keys, PyObject *value) {
    PyObject *attributes = PyDict_New();
    PyObject *called = attributes != NULL ? PyObject_CallFunctionObjArgs(describer.add_described, attributes,
                                                                         PyTuple_GET_ITEM(keys, 7), value, NULL)
                                          : NULL;
    if (called == NULL)
        Py_CLEAR(attributes);
    Py_XDECREF(called);
    return attributes;
}

static int out_value(Out *out, PyObject *keys, PyObject *value);

/* A plain list or tuple as describe/values.py describes one that is an
 * argument or a result: `list[N]` or `tuple[N]`, then its first
 * MAX_SEQUENCE_ITEMS items, each at its index's path. -2 (nothing written)
 * where one of those is a container, whose own items the Python path elides;
 * else as out_value. */
static int out_sequence(Out *out, PyObject *keys, PyObject *value) {
    int is_list = PyList_CheckExact(value);
    Py_ssize_t count = is_list ? PyList_GET_SIZE(value) : PyTuple_GET_SIZE(value);
    Py_ssize_t n = count < MAX_SEQUENCE_ITEMS ? count : MAX_SEQUENCE_ITEMS;
    PyObject *items[MAX_SEQUENCE_ITEMS];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = is_list ? PyList_GET_ITEM(value, i) : PyTuple_GET_ITEM(value, i);
        if (PyList_Check(item) || PyTuple_Check(item) || PyDict_Check(item))
            return -2;
    }
    /* Held, as the Python path's slice holds them: describing an item may run
     * Python code (a plan, the Python path) that changes the list. */
    for (Py_ssize_t i = 0; i < n; i++)
        items[i] = Py_NewRef(is_list ? PyList_GET_ITEM(value, i) : PyTuple_GET_ITEM(value, i));
    char head[40], *at = head + sizeof(head);
    *--at = ']';
    at = decimal(at, (long long)count);
    *--at = '[';
    at -= is_list ? 4 : 5;
    memcpy(at, is_list ? "list" : "tuple", is_list ? 4 : 5);
    int done = out_key(out, keys, 0) < 0 || out_utf8(out, at, (size_t)(head + sizeof(head) - at), 1, 0) < 0 ? -1 : 0;
    for (Py_ssize_t i = 0; i < n && done == 0; i++) {
        PyObject *inner = item_keys(keys, i);
        done = inner != NULL ? out_value(out, inner, items[i]) : -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(items[i]);
    return done;
}

/* `value` at the path of `keys`, as record/attributes.py writes it (level 3:
 * no statistics): 0, or -1 past the limit (no error set) or on an error to
 * raise; 1 where the Python path's attributes are data marshal refuses. */
static int out_value(Out *out, PyObject *keys, PyObject *value) {
    PyTypeObject *type = Py_TYPE(value);
    int done = -2; /* not one of the kinds written here */
    if ((PyObject *)type == describer.tensor_type || (PyObject *)type == describer.parameter_type) {
        done = out_tensor(out, keys, value);
        if (done != 0)
            return done < 0 ? -1 : 0;
        done = -2;
    } else if (value == Py_None) {
        done = out_key(out, keys, 0) < 0 || out_text(out, str_none, 0) < 0 ? -1 : 0;
    } else if (type == &PyBool_Type) {
        done = out_key(out, keys, 0) < 0 || out_put(out, value == Py_True ? "T" : "F", 1) < 0 ? -1 : 0;
    } else if (type == &PyLong_Type) {
        int overflow;
        long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (!overflow && !PyErr_Occurred()) /* OTLP's int64 holds it */
            done = out_key(out, keys, 0) < 0 || out_int(out, number) < 0 ? -1 : 0;
        PyErr_Clear();
    } else if (type == &PyFloat_Type) {
        double number = PyFloat_AS_DOUBLE(value);
        done = out_key(out, keys, 0) < 0 ? -1
               : isfinite(number)        ? out_float(out, number)
                                         : out_text(out, isnan(number) ? str_nan : number > 0 ? str_inf : str_minus_inf, 0);
    } else if (type == &PyUnicode_Type && PyUnicode_GET_LENGTH(value) <= TEXT_LIMIT) {
        done = out_keyed_text(out, keys, value);
    } else if (type == &PyList_Type || type == &PyTuple_Type) {
        done = out_sequence(out, keys, value);
    } else { /* an object its type's plan lets this core identify */
        done = out_identity(out, keys, value);
    }
    if (done != -2)
        return done;
    /* Any other value (containers, objects, enums, tensor subclasses, long
     * strings), by the Python path's own function, for this value alone. */
    PyObject *scratch = python_described(keys, value);
    PyObject *pairs = scratch != NULL ? dict_pairs(scratch) : NULL;
    Py_XDECREF(scratch);
    if (pairs == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError))
            return -1;
        PyErr_Clear();
        return 1;
    }
    done = out_put(out, PyBytes_AS_STRING(pairs), (size_t)PyBytes_GET_SIZE(pairs));
    Py_DECREF(pairs);
    return done;
}

/* A call's start attributes (the site's own, then its arguments'), as
 * marshal data appended to `out` (its record): 0, or -1 with no error set
 * where Python must record the call (too many arguments, too large, data
 * marshal refuses), or with one to raise. */
static int described_inputs(Out *out, PyObject *site_pairs, int skip_self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    Py_ssize_t first = skip_self && nargs > 0 ? 1 : 0;
    if (nargs - first + nkw > MAX_DESCRIBED_ARGS)
        return -1;
    int done = out_put(out, "{", 1);
    if (done == 0 && site_pairs != NULL)
        done = out_put(out, PyBytes_AS_STRING(site_pairs), (size_t)PyBytes_GET_SIZE(site_pairs));
    for (Py_ssize_t i = first; i < nargs && done == 0; i++) {
        PyObject *keys = Py_XNewRef(arg_keys(i - first)); /* held, as in described_output */
        done = keys != NULL ? out_value(out, keys, args[i]) : -1;
        Py_XDECREF(keys);
    }
    for (Py_ssize_t i = 0; i < nkw && done == 0; i++) {
        PyObject *keys = kw_keys(PyTuple_GET_ITEM(kwnames, i));
        done = keys != NULL ? out_value(out, keys, args[nargs + i]) : -1;
        Py_XDECREF(keys);
    }
    if (done == 0)
        done = out_put(out, "0", 1);
    return done == 0 ? 0 : -1;
}

/* The attributes a call's result adds at its end, as marshal data appended
 * to `out` (its record): 0, or -1 with an error set. */
static int described_output(Out *out, PyObject *result) {
    if (describer.output_keys == NULL) {
        PyObject *path = PyUnicode_FromString("output");
        describer.output_keys = path != NULL ? keys_of(path) : NULL;
        Py_XDECREF(path);
        if (describer.output_keys == NULL)
            return -1;
    }
    PyObject *keys = Py_NewRef(describer.output_keys); /* held: describing runs Python code, and set_describer replaces them */
    size_t mark = out->size;
    int done = out_put(out, "{", 1);
    if (done == 0)
        done = out_value(out, keys, result);
    if (done == 0)
        done = out_put(out, "0", 1);
    if (done == 0 || PyErr_Occurred()) {
        Py_DECREF(keys);
        return done == 0 ? 0 : -1;
    }
    /* Data marshal refuses, or too large: the Python path's attributes, as its encoder writes them. */
    out->size = mark;
    PyObject *attributes = python_described(keys, result);
    Py_DECREF(keys);
    PyObject *data = attributes != NULL ? PyObject_CallOneArg(describer.encode, attributes) : NULL;
    Py_XDECREF(attributes);
    if (data == NULL)
        return -1;
    done = PyBytes_Check(data) ? out_put(out, PyBytes_AS_STRING(data), (size_t)PyBytes_GET_SIZE(data)) : -1;
    Py_DECREF(data);
    if (done < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "a result's metadata too large to record");
    return done;
}

/* -- Recorded ---------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *function; /* the kernel */
    PyObject *slow;     /* the Python wrapper, for every call this core does not record */
    PyObject *site;     /* its KernelSite */
    PyObject *name;
    long level;
    unsigned long long symbol_ring; /* the ring `symbol` is valid for (0: none) */
    unsigned long symbol;
    /* A CUDA graph's replay (capture/graphs.py), or NULL: where a graph keeps
     * its Graph, the thread-local whose `attributes` an integration sets, and
     * the list [pending replay, output check on]. */
    PyObject *graph_attribute, *replay_context, *replays;
    /* The site's own attributes (the module a layer's call runs in), marshalled once, or NULL;
     * and their key and value pairs alone (marshal version 2), which a call's described arguments follow. */
    PyObject *attributes, *attribute_pairs;
    int skip_self; /* its KernelSite's: a leading self or cls is not an argument */
    PyObject *dict;
    PyObject *weakrefs;
} Recorded;

static int compiling(void) {
    if (core.compiler != NULL) { /* torch.compiler's namespace: its flag, read as is_compiling() reads it */
        PyObject *flag = PyDict_GetItemWithError(core.compiler, str_flag);
        if (flag == NULL)
            PyErr_Clear();
        return flag == Py_True;
    }
    if (core.is_compiling == NULL)
        return 0;
    PyObject *flag = PyObject_CallNoArgs(core.is_compiling);
    if (flag == NULL) {
        PyErr_Clear();
        return 0;
    }
    int yes = flag == Py_True;
    Py_DECREF(flag);
    return yes;
}

/* Whether the runtime's spans are set up with nothing to hand calls to: no
 * processor to deliver to (sidecar export, the black box), or a provider
 * whose processors are all the trace file's (spans.py: _targets None for
 * the processors it last saw). */
static int spans_ready(void) {
    if (core.spans_ready == 1)
        return 1;
    if (core.spans == NULL)
        return 0;
    if (core.spans_ready == 2) {
        PyObject *present = PyObject_GetAttr(core.processors, str_span_processors);
        if (present == NULL) {
            PyErr_Clear();
            return 0;
        }
        int same = present == core.seen;
        if (!same) {
            /* Changed since: fast again once Python has looked at them and found no other. */
            PyObject *seen = PyObject_GetAttr(core.spans, str_seen);
            PyObject *targets = seen != NULL ? PyObject_GetAttr(core.spans, str_targets) : NULL;
            if (seen == present && targets == Py_None) {
                Py_XSETREF(core.seen, Py_NewRef(present));
                same = 1;
            }
            Py_XDECREF(seen);
            Py_XDECREF(targets);
            PyErr_Clear();
        }
        Py_DECREF(present);
        return same;
    }
    PyObject *provider = PyObject_GetAttr(core.spans, str_provider);
    if (provider == NULL) {
        PyErr_Clear();
        return 0;
    }
    int set_up = provider != Py_None;
    Py_DECREF(provider);
    if (!set_up)
        return 0;
    PyObject *processors = PyObject_GetAttr(core.spans, str_processors);
    if (processors == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (processors == Py_None) {
        core.spans_ready = 1;
        Py_DECREF(processors);
        return 1;
    }
    Py_XSETREF(core.processors, processors);
    Py_CLEAR(core.seen);
    core.spans_ready = 2;
    return 0;
}

/* This site's name as a symbol of the current ring: 0 when Python must
 * write it first (or cannot: the table is full, and the name goes inline). */
static unsigned long site_symbol(Recorded *self) {
    if (self->symbol_ring == core.ring->id)
        return self->symbol;
    PyObject *symbols = PyObject_GetAttr(core.writer, str_symbols);
    if (symbols == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *number = PyDict_Check(symbols) ? PyDict_GetItemWithError(symbols, self->name) : NULL;
    unsigned long symbol = number != NULL && PyLong_Check(number) ? PyLong_AsUnsignedLong(number) : 0;
    Py_DECREF(symbols);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (symbol != 0 && symbol <= 0xFFFFFFFFul) {
        self->symbol_ring = core.ring->id;
        self->symbol = symbol;
        return symbol;
    }
    return 0;
}

/* The parent root calls in `context` take: span `parent_id` (0: none, each
 * call starts a trace) of trace `trace` (`hi`, `lo`), with `flags`. */
static void keep_parent(PyObject *context, PyObject *trace, uint64_t hi, uint64_t lo, uint64_t parent_id,
                        unsigned flags) {
    Py_XSETREF(core.last_context, Py_NewRef(context));
    Py_XSETREF(core.last_trace, parent_id ? Py_NewRef(trace) : NULL);
    core.trace_hi = hi;
    core.trace_lo = lo;
    core.parent_id = parent_id;
    core.parent_flags = flags;
}

/* Takes `parent`, parent_of's (context, trace id, parent id, flags), as
 * what a root call in that context is given (a borrowed reference). */
static int use_parent(PyObject *parent) {
    if (!PyTuple_Check(parent) || PyTuple_GET_SIZE(parent) != 4) {
        PyErr_SetString(PyExc_TypeError, "_parent_of gives (context, trace id, parent id, flags)");
        return -1;
    }
    uint64_t hi, lo;
    unsigned long long parent_id = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(parent, 2));
    unsigned long flags = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(parent, 3));
    if (PyErr_Occurred() || split128(PyTuple_GET_ITEM(parent, 1), &hi, &lo) < 0)
        return -1;
    keep_parent(PyTuple_GET_ITEM(parent, 0), PyTuple_GET_ITEM(parent, 1), hi, lo, parent_id, (unsigned)flags);
    return 0;
}

/* The parent of a root call (no call of this thread around it): from the
 * current OpenTelemetry context, which consecutive calls mostly share. */
static int root_parent(void) {
    PyObject *context;
    if (core.context_var != NULL) {
        if (PyContextVar_Get(core.context_var, NULL, &context) < 0)
            return -1;
        if (context == NULL)
            context = Py_NewRef(Py_None);
    } else {
        context = PyObject_CallNoArgs(core.get_current);
        if (context == NULL)
            return -1;
    }
    if (context == core.last_context) {
        Py_DECREF(context);
        return 0;
    }
    PyObject *parent = PyObject_CallOneArg(core.parent_of, context);
    Py_DECREF(context);
    if (parent == NULL)
        return -1;
    int done = use_parent(parent);
    Py_DECREF(parent);
    return done;
}

/* A context's parent told ahead (parent_of's tuple for it): a batch that
 * attaches a new context every step spares its first call the look. */
static PyObject *prime_parent(PyObject *module, PyObject *parent) {
    if (use_parent(parent) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* A record into `ring`, inline, else through the writer's locked path. */
static int write_record(PyObject *writer, Ring *ring, unsigned encoding, const unsigned char *payload, size_t n) {
    if (ring_copy(ring, encoding, payload, n))
        return 0;
    PyObject *number = PyLong_FromUnsignedLong(encoding);
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)payload, (Py_ssize_t)n);
    PyObject *result = number && bytes ? PyObject_CallMethodObjArgs(writer, str_write_record, number, bytes, NULL) : NULL;
    Py_XDECREF(number);
    Py_XDECREF(bytes);
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

/* -- batch spans ------------------------------------------------------------ */

/* A serving engine opens a batch span every step (record/file_spans.py's
 * FileSpan, written straight into the trace file): here its start, its
 * context attached and its end are one call each, where Python took a dozen
 * frames, each cold after the engine's own step (about 40 us a step on
 * SGLang's real server). Anything unusual goes through Python: an end with
 * events or a description, a file this core does not write, a failure. */

#define SPAN_START_SIZE 58 /* <QQQQqQIIBB */
#define ENCODING_SPAN_START 4
#define FLAG_REMOTE_PARENT 2

static struct {
    PyObject *span_context; /* opentelemetry.trace.SpanContext */
    PyObject *sampled;      /* TraceFlags(TraceFlags.SAMPLED) */
    PyObject *default_state; /* DEFAULT_TRACE_STATE */
    PyObject *context;      /* opentelemetry.context.Context */
    PyObject *span_key, *batch_key; /* where a context holds its span, and its batch */
    PyObject *calls_key;    /* sglang.batch.kernel_calls */
    PyObject *end;          /* (span, end time): an end Python writes */
    PyObject *failed;       /* (span, exception): a batch that raised */
    PyObject *detach_failed; /* (exception): a context that could not be detached */
} batch;

/* A FileSpan's fields (the compiled core's base of FileSpan). */
typedef struct {
    PyObject_HEAD
    PyObject *context, *added, *events, *description;
    int status;
    char ended;
} SpanRecord;

static int span_record_traverse(SpanRecord *self, visitproc visit, void *arg) {
    Py_VISIT(self->context);
    Py_VISIT(self->added);
    Py_VISIT(self->events);
    Py_VISIT(self->description);
    return 0;
}

static int span_record_clear(SpanRecord *self) {
    Py_CLEAR(self->context);
    Py_CLEAR(self->added);
    Py_CLEAR(self->events);
    Py_CLEAR(self->description);
    return 0;
}

/* A subclass's (FileSpan's) dealloc untracks it and lets its type go itself. */
static void span_record_dealloc(SpanRecord *self) {
    PyObject_GC_UnTrack(self);
    span_record_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The end record of a span that added attributes only, written here; else
 * (events, a description, no file, an error) Python's `end` writes it. */
static int span_record_write_end(SpanRecord *self, long long end) {
    if (core.writer == NULL)
        return 0;
    int events = self->events != NULL && PyList_Check(self->events) && PyList_GET_SIZE(self->events);
    int described = self->description != NULL && self->description != Py_None &&
                    (!PyUnicode_Check(self->description) || PyUnicode_GET_LENGTH(self->description));
    if (!events && !described && PyTuple_Check(self->context) && PyTuple_GET_SIZE(self->context) == 6 &&
        PyDict_CheckExact(self->added)) {
        unsigned long long span_id = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(self->context, 1));
        PyObject *added = PyDict_GET_SIZE(self->added) ? PyMarshal_WriteObjectToString(self->added, MARSHAL_VERSION)
                                                      : NULL;
        if (!PyErr_Occurred()) {
            Py_ssize_t extra = added ? PyBytes_GET_SIZE(added) : 0;
            unsigned char fixed[COMPACT_END_SIZE];
            unsigned char *record = extra ? PyMem_Malloc(COMPACT_END_SIZE + extra) : fixed;
            int done = -1;
            if (record != NULL) {
                put_u64(record, span_id);
                put_u64(record + 8, (uint64_t)end);
                record[16] = (unsigned char)self->status;
                if (extra)
                    memcpy(record + COMPACT_END_SIZE, PyBytes_AS_STRING(added), extra);
                done = write_record(core.writer, core.ring, extra ? ENCODING_ATTRIBUTED_END : ENCODING_COMPACT_END,
                                    record, COMPACT_END_SIZE + extra);
                if (extra)
                    PyMem_Free(record);
            }
            Py_XDECREF(added);
            if (done == 0)
                return 0;
        }
        Py_XDECREF(added);
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return -1;
        PyErr_Clear();
    }
    PyObject *at = PyLong_FromLongLong(end);
    PyObject *done = at ? PyObject_CallFunctionObjArgs(batch.end, (PyObject *)self, at, NULL) : NULL;
    Py_XDECREF(at);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

static PyObject *span_record_end(SpanRecord *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *end_time = nargs ? args[0] : Py_None;
    if (kwnames != NULL) {
        if (nargs || PyTuple_GET_SIZE(kwnames) != 1 || !PyUnicode_Check(PyTuple_GET_ITEM(kwnames, 0)) ||
            PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "end_time") != 0) {
            PyErr_SetString(PyExc_TypeError, "end(end_time=None)");
            return NULL;
        }
        end_time = args[0];
    } else if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "end(end_time=None)");
        return NULL;
    }
    if (self->ended)
        Py_RETURN_NONE;
    long long end = end_time == Py_None ? 0 : PyLong_AsLongLong(end_time);
    if (end == -1 && PyErr_Occurred())
        return NULL;
    self->ended = 1;
    if (span_record_write_end(self, end ? end : now_ns()) < 0)
        return NULL;
    Py_RETURN_NONE;
}

#ifdef SOK_TIMING
/* bench/sglang_own_time.py's build: the time batch spans take to close and end, summed. */
static long long timing_batch;

static PyObject *span_record_end_timed(SpanRecord *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    long long began = now_ns();
    PyObject *result = span_record_end(self, args, nargs, kwnames);
    timing_batch += now_ns() - began;
    return result;
}
#define SPAN_RECORD_END span_record_end_timed
#else
#define SPAN_RECORD_END span_record_end
#endif

static PyObject *span_record_get_span_context(SpanRecord *self, PyObject *unused) {
    return Py_NewRef(self->context ? self->context : Py_None);
}

static PyObject *span_record_is_recording(SpanRecord *self, PyObject *unused) {
    return PyBool_FromLong(!self->ended);
}

static PyMethodDef span_record_methods[] = {
    {"end", (PyCFunction)(void (*)(void))SPAN_RECORD_END, METH_FASTCALL | METH_KEYWORDS,
     "end(end_time=None): the end record, once."},
    {"get_span_context", (PyCFunction)span_record_get_span_context, METH_NOARGS, "Its SpanContext."},
    {"is_recording", (PyCFunction)span_record_is_recording, METH_NOARGS, "Until it ends."},
    {NULL}};

static PyMemberDef span_record_members[] = {
    {"_context", T_OBJECT, offsetof(SpanRecord, context), 0, NULL},
    {"_added", T_OBJECT, offsetof(SpanRecord, added), 0, NULL},
    {"_events", T_OBJECT, offsetof(SpanRecord, events), 0, NULL},
    {"_description", T_OBJECT, offsetof(SpanRecord, description), 0, NULL},
    {"_status", T_INT, offsetof(SpanRecord, status), 0, NULL},
    {"_ended", T_BOOL, offsetof(SpanRecord, ended), 0, NULL},
    {NULL}};

static PyTypeObject SpanRecordType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sglang_otel_kernels._native.SpanRecord",
    .tp_basicsize = sizeof(SpanRecord),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A span's fields and its end record (the base of record/file_spans.py's FileSpan).",
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)span_record_traverse,
    .tp_clear = (inquiry)span_record_clear,
    .tp_dealloc = (destructor)span_record_dealloc,
    .tp_methods = span_record_methods,
    .tp_members = span_record_members,
};

/* A batch span open_batch opened, its context attached (requests.py's OpenBatch). */
typedef struct {
    PyObject_HEAD
    PyObject *span, *token, *state, *calls_before;
    int end_later;
} BatchScope;

static void batch_scope_dealloc(BatchScope *self) {
    Py_XDECREF(self->span);
    Py_XDECREF(self->token);
    Py_XDECREF(self->state);
    Py_XDECREF(self->calls_before);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* close(exc): after the batch ran (None) or raised `exc`, recorded on its
 * span; the context detached, the span ended (left open where it ran and was
 * opened with end_later), with the kernel calls made inside. */
static PyObject *batch_scope_close(BatchScope *self, PyObject *exc) {
    if (self->token == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a batch closed twice");
        return NULL;
    }
    SpanRecord *span = (SpanRecord *)self->span;
    PyObject *type = NULL, *value = NULL, *traceback = NULL;
    if (exc != Py_None) {
        PyObject *done = PyObject_CallFunctionObjArgs(batch.failed, self->span, exc, NULL);
        Py_XDECREF(done);
        if (done == NULL)
            PyErr_Fetch(&type, &value, &traceback); /* raised once the rest is done, as Python's finally */
    }
    PyObject *token = self->token;
    self->token = NULL;
    if (PyContextVar_Reset(core.context_var, token) < 0) {
        /* as OpenTelemetry's detach: a token of another context is told, not raised */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyErr_NormalizeException(&t, &v, &tb);
        PyObject *told = v != NULL && PyErr_GivenExceptionMatches(v, PyExc_Exception)
                             ? PyObject_CallOneArg(batch.detach_failed, v) : NULL;
        if (told == NULL && v != NULL && !PyErr_GivenExceptionMatches(v, PyExc_Exception))
            PyErr_Restore(t, v, tb);
        else {
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
        }
        Py_XDECREF(told);
    }
    Py_DECREF(token);
    int ok = !PyErr_Occurred();
    if (ok && !span->ended) {
        PyObject *calls = PyNumber_Subtract(PyList_GET_ITEM(self->state, 3), self->calls_before);
        ok = calls != NULL && PyDict_SetItem(span->added, batch.calls_key, calls) == 0;
        Py_XDECREF(calls);
    }
    if (ok && (exc != Py_None || !self->end_later) && !span->ended) {
        span->ended = 1;
        ok = span_record_write_end(span, now_ns()) == 0;
    }
    if (type != NULL) {
        if (!ok)
            PyErr_Clear();
        PyErr_Restore(type, value, traceback);
        return NULL;
    }
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *batch_scope_get_span(BatchScope *self, void *closure) {
    return Py_NewRef(self->span);
}

#ifdef SOK_TIMING
static PyObject *batch_scope_close_timed(BatchScope *self, PyObject *exc) {
    long long began = now_ns();
    PyObject *result = batch_scope_close(self, exc);
    timing_batch += now_ns() - began;
    return result;
}
#define BATCH_SCOPE_CLOSE batch_scope_close_timed
#else
#define BATCH_SCOPE_CLOSE batch_scope_close
#endif

static PyMethodDef batch_scope_methods[] = {
    {"close", (PyCFunction)BATCH_SCOPE_CLOSE, METH_O,
     "close(exc): after the batch ran (None) or raised exc: its context detached, its span ended."},
    {NULL}};

static PyGetSetDef batch_scope_getset[] = {{"span", (getter)batch_scope_get_span, NULL, "The batch span.", NULL},
                                           {NULL}};

static PyTypeObject BatchScopeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sglang_otel_kernels._native.BatchScope",
    .tp_basicsize = sizeof(BatchScope),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A batch span open_batch opened: span, and close(exc).",
    .tp_dealloc = (destructor)batch_scope_dealloc,
    .tp_methods = batch_scope_methods,
    .tp_getset = batch_scope_getset,
};

static PyObject *set_batch(PyObject *module, PyObject *args) {
    PyObject *fields[10];
    if (!PyArg_ParseTuple(args, "OOOOOOOOOO:set_batch", &fields[0], &fields[1], &fields[2], &fields[3], &fields[4],
                          &fields[5], &fields[6], &fields[7], &fields[8], &fields[9]))
        return NULL;
    if (!PyType_Check(fields[0]) || !PyType_IsSubtype((PyTypeObject *)fields[0], &PyTuple_Type) ||
        !PyType_Check(fields[3]) || !PyType_IsSubtype((PyTypeObject *)fields[3], &PyDict_Type)) {
        PyErr_SetString(PyExc_TypeError, "set_batch: SpanContext (a tuple type), ..., Context (a dict type), ...");
        return NULL;
    }
    PyObject **slots[] = {&batch.span_context, &batch.sampled, &batch.default_state, &batch.context, &batch.span_key,
                          &batch.batch_key, &batch.calls_key, &batch.end, &batch.failed, &batch.detach_failed};
    for (int i = 0; i < 10; i++)
        Py_XSETREF(*slots[i], Py_NewRef(fields[i]));
    Py_RETURN_NONE;
}

/* open_batch(span type, start, parent, trace id, current, batch, end_later):
 * a batch span (a new `span type`, FileSpan) started in the trace file, its
 * context (`current` with the span and `batch`) attached and given as the
 * parent of the kernel calls about to run; a BatchScope. `start`: (the
 * scope's symbol, flags, the name's symbol, attributes and links as marshal
 * data), as the file the core writes names them; `parent`: a valid
 * SpanContext or None; `trace id`: a root's, or None (random). None where
 * Python must write it: no file here, or this thread not yet noted in it. */
static PyObject *open_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyType_Check(args[0]) || !PyType_IsSubtype((PyTypeObject *)args[0], &SpanRecordType) ||
        !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != 4 || !PyBytes_Check(PyTuple_GET_ITEM(args[1], 3))) {
        PyErr_SetString(PyExc_TypeError, "open_batch(span type, (scope, flags, symbol, data), parent, trace id, "
                                         "current, batch, end_later)");
        return NULL;
    }
    if (batch.context == NULL || core.context_var == NULL || core.writer == NULL ||
        core.ring == NULL || core.ring->inline_end < 0)
        Py_RETURN_NONE;
    PyObject *start = args[1], *parent = args[2], *trace_id = args[3], *current = args[4];
    PyObject *state = thread_state();
    if (state == NULL)
        return NULL;
    if (!PyList_CheckExact(state) || PyList_GET_SIZE(state) != 4 || PyList_GET_ITEM(state, 0) != core.writer) {
        Py_DECREF(state);
        Py_RETURN_NONE;
    }
    unsigned long scope = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(start, 0));
    unsigned long flags = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(start, 1));
    unsigned long symbol = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(start, 2));
    uint64_t ident = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(state, 1));
    PyObject *data = PyTuple_GET_ITEM(start, 3);
    PyObject *trace = NULL, *trace_state = batch.default_state, *span_id_object = NULL, *items = NULL;
    PyObject *context = NULL, *span = NULL, *published = NULL, *token = NULL;
    unsigned char *record = NULL;
    BatchScope *scope_object = NULL;
    uint64_t hi, lo, parent_id = 0;
    if (PyErr_Occurred())
        goto fail;
    flags |= FLAG_SAMPLED;
    if (parent != Py_None) {
        if (!PyTuple_Check(parent) || PyTuple_GET_SIZE(parent) != 6) {
            PyErr_SetString(PyExc_TypeError, "open_batch: a parent is a SpanContext");
            goto fail;
        }
        trace = Py_NewRef(PyTuple_GET_ITEM(parent, 0));
        trace_state = PyTuple_GET_ITEM(parent, 4);
        parent_id = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(parent, 1));
        if (PyObject_IsTrue(PyTuple_GET_ITEM(parent, 2)) == 1)
            flags |= FLAG_REMOTE_PARENT;
        if (PyLong_AsUnsignedLong(PyTuple_GET_ITEM(parent, 3)) & 1)
            flags |= FLAG_PARENT_SAMPLED;
        if (PyErr_Occurred() || split128(trace, &hi, &lo) < 0)
            goto fail;
    } else if (trace_id != Py_None) {
        trace = Py_NewRef(trace_id);
        if (split128(trace, &hi, &lo) < 0)
            goto fail;
    } else if ((trace = random_trace(&hi, &lo)) == NULL)
        goto fail;
    uint64_t span_id = random_span_id();
    /* The SpanContext, made as tuple.__new__(SpanContext, ...) (its __new__'s checks are Python). */
    if ((span_id_object = PyLong_FromUnsignedLongLong(span_id)) == NULL ||
        (items = PyTuple_Pack(6, trace, span_id_object, Py_False, batch.sampled, trace_state, Py_True)) == NULL)
        goto fail;
    {
        PyObject *packed = PyTuple_Pack(1, items);
        context = packed ? PyTuple_Type.tp_new((PyTypeObject *)batch.span_context, packed, NULL) : NULL;
        Py_XDECREF(packed);
        if (context == NULL)
            goto fail;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(data);
    if ((record = PyMem_Malloc(SPAN_START_SIZE + size)) == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    {
        uint32_t scope32 = (uint32_t)scope;
        put_span_head(record, hi, lo, span_id, parent_id, now_ns(), ident, (uint32_t)symbol);
        memcpy(record + 52, &scope32, 4);
        record[56] = 0; /* kind: internal */
        record[57] = (unsigned char)flags;
        memcpy(record + SPAN_START_SIZE, PyBytes_AS_STRING(data), size);
    }
    if (write_record(core.writer, core.ring, ENCODING_SPAN_START, record, SPAN_START_SIZE + size) < 0)
        goto fail;
    SpanRecord *made = (SpanRecord *)((PyTypeObject *)args[0])->tp_alloc((PyTypeObject *)args[0], 0);
    if ((span = (PyObject *)made) == NULL)
        goto fail;
    made->context = Py_NewRef(context);
    if ((made->added = PyDict_New()) == NULL || (made->events = PyList_New(0)) == NULL)
        goto fail;
    /* Its context: `current` with it as the current span, and the batch. */
    if ((published = current == Py_None ? PyObject_CallNoArgs(batch.context)
                                      : PyObject_CallOneArg(batch.context, current)) == NULL ||
        PyDict_SetItem(published, batch.span_key, span) < 0 || PyDict_SetItem(published, batch.batch_key, args[5]) < 0)
        goto fail;
    if ((scope_object = PyObject_New(BatchScope, &BatchScopeType)) == NULL)
        goto fail;
    scope_object->span = Py_NewRef(span);
    scope_object->state = Py_NewRef(state);
    scope_object->calls_before = Py_NewRef(PyList_GET_ITEM(state, 3));
    scope_object->end_later = PyObject_IsTrue(args[6]) == 1;
    scope_object->token = NULL;
    if ((token = PyContextVar_Set(core.context_var, published)) == NULL)
        goto fail;
    scope_object->token = token;
    token = NULL;
    /* The kernel calls about to run have it as their parent, without looking (as prime_parent). */
    keep_parent(published, trace, hi, lo, span_id, FLAG_SAMPLED | FLAG_PARENT_SAMPLED);
    goto done;
fail:
    Py_CLEAR(scope_object);
done:
    PyMem_Free(record);
    Py_XDECREF(trace);
    Py_XDECREF(span_id_object);
    Py_XDECREF(items);
    Py_XDECREF(context);
    Py_XDECREF(span);
    Py_XDECREF(published);
    Py_DECREF(state);
    return (PyObject *)scope_object;
}

/* What graphs.py's hooks give a replay, done here: its attributes as marshal
 * data (`*extra`, or NULL: none) and its call number, the graph's id and
 * replay number packed (`*seq`). 1 when done; 0 (nothing consumed, no error
 * set) when Python's hooks must do it: a graph it has not seen, the output
 * check on, attributes marshal refuses or too large. */
static int replay_fields(Recorded *self, PyObject *const *args, size_t nargsf, PyObject **extra,
                         unsigned long long *seq) {
    *extra = NULL;
    if (PyVectorcall_NARGS(nargsf) < 1 || !PyList_CheckExact(self->replays) || PyList_GET_SIZE(self->replays) != 2 ||
        PyList_GET_ITEM(self->replays, 1) != Py_False)
        return 0;
    PyObject *info = PyObject_GetAttr(args[0], self->graph_attribute);
    PyObject *attributes = info != NULL ? PyObject_GetAttr(self->replay_context, str_attributes) : NULL;
    PyObject *next = NULL, *number = NULL;
    int done = 0;
    if (attributes == NULL || info == Py_None)
        goto out;
    if (attributes != Py_None) {
        if (!PyDict_CheckExact(attributes))
            goto out;
        if (PyDict_GET_SIZE(attributes)) {
            *extra = PyMarshal_WriteObjectToString(attributes, MARSHAL_VERSION);
            if (*extra == NULL || PyBytes_GET_SIZE(*extra) > MAX_INLINE_EXTRA)
                goto out;
        }
    }
    next = PyObject_GetAttr(info, str_numbers); /* the graph's itertools.count of replay numbers */
    number = next != NULL && PyIter_Check(next) ? PyIter_Next(next) : NULL;
    if (number == NULL)
        goto out;
    *seq = PyLong_AsUnsignedLongLong(number);
    done = !PyErr_Occurred();
out:
    if (!done) {
        PyErr_Clear();
        Py_CLEAR(*extra);
    }
    Py_XDECREF(info);
    Py_XDECREF(attributes);
    Py_XDECREF(next);
    Py_XDECREF(number);
    return done;
}

#ifdef SOK_TIMING
/* A build for bench/sglang_own_time.py: the time the calls this core records
 * spend outside their kernels, summed (four clock reads a call, in it). */
static long long timing_own, timing_calls;

static PyObject *timing(PyObject *module, PyObject *unused) {
    return Py_BuildValue("LLL", timing_calls, timing_own, timing_batch);
}

static PyObject *recorded_call_timed(Recorded *self, PyObject *const *args, size_t nargsf, PyObject *kwnames,
                                     long long *kernel_ns);

static PyObject *recorded_call(Recorded *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    long long kernel = -1, entered = now_ns(); /* -1: not recorded here (the Python path records it) */
    PyObject *result = recorded_call_timed(self, args, nargsf, kwnames, &kernel);
    if (kernel >= 0) { /* the kernel's time holds the calls it made: their own time is theirs */
        timing_own += now_ns() - entered - kernel;
        timing_calls++;
    }
    return result;
}

#define RECORDED_CALL recorded_call_timed
#define TIMED_PARAMETER , long long *kernel_ns
#define KERNEL_BEGINS() long long kernel_began = now_ns()
#define KERNEL_ENDED() (*kernel_ns = now_ns() - kernel_began)
#else
#define RECORDED_CALL recorded_call
#define TIMED_PARAMETER
#define KERNEL_BEGINS() ((void)0)
#define KERNEL_ENDED() ((void)0)
#endif

static PyObject *RECORDED_CALL(Recorded *self, PyObject *const *args, size_t nargsf, PyObject *kwnames TIMED_PARAMETER) {
    if (compiling())
        return PyObject_Vectorcall(self->function, args, nargsf, kwnames);
    int describe = self->level > core.bare_upto; /* its arguments too */
    if (core.capturing ||
        (describe && (self->level > core.described_upto || self->replays != NULL || describer.add_described == NULL)) ||
        core.ring == NULL || core.ring->inline_end < 0 || !spans_ready())
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    /* A kernel's first call into this file, and a thread's, go through Python,
     * which writes the kernel's name and the thread's: before describing, which
     * would otherwise run twice (and an object's Python code with it). */
    unsigned long symbol = site_symbol(self);
    if (symbol == 0)
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    PyObject *state = thread_state();
    if (state == NULL)
        return NULL;
    if (!PyList_CheckExact(state) || PyList_GET_SIZE(state) != 4 || PyList_GET_ITEM(state, 0) != core.writer) {
        Py_DECREF(state);
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    }
    /* Then describing, as it may run Python code (the Python path's function
     * for an object): what was read above is checked again after it. */
    Out opening; /* the KERNEL_SPAN record: its fixed fields, then its attributes */
    out_init(&opening, KERNEL_SPAN_SIZE + MAX_INLINE_EXTRA);
    opening.size = KERNEL_SPAN_SIZE;
    if (describe) {
        if (described_inputs(&opening, self->attribute_pairs, self->skip_self, args, PyVectorcall_NARGS(nargsf),
                             kwnames) < 0) {
            Py_DECREF(state);
            out_free(&opening);
            if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception))
                return NULL; /* KeyboardInterrupt and the like, as the Python path lets them through */
            PyErr_Clear();
            return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
        }
        /* The ring, the kernel's name in it and the thread's writer, as they are
         * now: a reconfiguration while describing sends the call through Python. */
        symbol = core.ring == NULL || core.ring->inline_end < 0 ? 0 : site_symbol(self);
        if (symbol == 0 || PyList_GET_ITEM(state, 0) != core.writer) {
            Py_DECREF(state);
            out_free(&opening);
            return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
        }
    }
    PyObject *outer = Py_NewRef(PyList_GET_ITEM(state, 2));
    PyObject *writer = Py_NewRef(core.writer);
    Ring *ring = (Ring *)Py_NewRef((PyObject *)core.ring);
    PyObject *trace = NULL, *result = NULL;
    InFlight *call = NULL;
    PyObject *extra = NULL; /* a replay's attributes or the site's, marshalled (a described call's are in `opening`) */
    unsigned long long seq;
    unsigned kind_flags = 0;
    PyObject *then = NULL; /* what runs the kernel instead, once this core let go of its references */
    uint64_t hi, lo, parent_id;
    unsigned flags;
    if (outer != Py_None) {
        if (Py_IS_TYPE(outer, &InFlightType) && ((InFlight *)outer)->trace != NULL) { /* a call this core records */
            InFlight *around = (InFlight *)outer;
            trace = Py_NewRef(around->trace);
            parent_id = around->span_id;
            flags = around->flags;
        } else if (PyTuple_Check(outer) && PyTuple_GET_SIZE(outer) >= 3) { /* one the Python path records */
            trace = Py_NewRef(PyTuple_GET_ITEM(outer, 0));
            parent_id = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(outer, 1));
            flags = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(outer, 2));
        } else
            goto slow;
        flags = (flags & FLAG_SAMPLED) * (FLAG_SAMPLED | FLAG_PARENT_SAMPLED); /* sampled, and so is its parent */
        if (PyErr_Occurred() || split128(trace, &hi, &lo) < 0)
            goto slow;
    } else {
        if (root_parent() < 0)
            goto slow;
        flags = core.parent_flags;
        parent_id = core.parent_id;
        if (parent_id) {
            hi = core.trace_hi;
            lo = core.trace_lo;
            trace = Py_NewRef(core.last_trace);
        } else if ((trace = random_trace(&hi, &lo)) == NULL)
            goto slow;
    }
    if (self->replays != NULL) { /* last before numbering: Python's hooks take a replay this cannot */
        if (!replay_fields(self, args, nargsf, &extra, &seq))
            goto slow;
        kind_flags = FLAG_GRAPH_REPLAY;
    } else if (!describe && self->attributes != NULL) {
        extra = Py_NewRef(self->attributes);
    }
    flags |= core.span_flags | kind_flags;
    uint64_t span_id = random_span_id();
    if (!kind_flags)
        seq = ++core.seq;
    core.recorded++;
    PyObject *calls = PyNumber_Add(PyList_GET_ITEM(state, 3), one);
    if (calls == NULL)
        goto fail;
    PyList_SetItem(state, 3, calls);
    long long start = now_ns();
    if (extra != NULL && out_put(&opening, PyBytes_AS_STRING(extra), (size_t)PyBytes_GET_SIZE(extra)) < 0)
        goto fail;
    {
        unsigned char *record = opening.data;
        uint64_t ident;
        ident = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(state, 1));
        put_span_head(record, hi, lo, span_id, parent_id, start, ident, (uint32_t)symbol);
        record[52] = 0; /* kind: internal */
        record[53] = (unsigned char)flags;
        put_u64(record + 54, seq);
        record[62] = (unsigned char)self->level;
        if (PyErr_Occurred() || write_record(writer, ring, ENCODING_KERNEL_SPAN, record, opening.size) < 0)
            goto fail;
    }
    /* The call as the Python side reads it (record/spans.py: TRACE_ID ... CALL_SEQ). */
    if ((call = in_flight_new()) == NULL)
        goto fail;
    call->trace = trace;
    trace = NULL;
    call->outer = Py_NewRef(outer);
    call->writer = Py_NewRef(writer);
    call->name = Py_NewRef(self->name);
    call->state = Py_NewRef(state);
    call->span_id = span_id;
    call->parent_id = parent_id;
    call->seq = seq;
    call->start = start;
    call->flags = flags;
    if (PyList_SetItem(state, 2, Py_NewRef((PyObject *)call)) < 0)
        goto fail;

    KERNEL_BEGINS();
    result = PyObject_Vectorcall(self->function, args, nargsf, kwnames);
    KERNEL_ENDED();

    PyList_SetItem(state, 2, Py_NewRef(outer));
    if (result == NULL) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (traceback != NULL && value != NULL)
            PyException_SetTraceback(value, traceback);
        PyObject *done = PyObject_CallFunctionObjArgs(core.failed, self->site, (PyObject *)call,
                                                   value ? value : Py_None, NULL);
        if (done == NULL)
            PyErr_WriteUnraisable(self->slow);
        Py_XDECREF(done);
        PyErr_Restore(type, value, traceback);
    } else {
        Out record; /* the end: its fixed fields, then the result's attributes */
        out_init(&record, COMPACT_END_SIZE + MAX_DESCRIBED_OUTPUT);
        record.size = COMPACT_END_SIZE;
        long long end = now_ns();
        if (kind_flags) { /* the replay a device error met later is blamed on */
            PyObject *pending = PyLong_FromUnsignedLongLong(seq);
            if (pending == NULL || PyList_SetItem(self->replays, 0, pending) < 0)
                PyErr_WriteUnraisable(self->slow);
        }
        /* The result's metadata, read once the kernel returned, as the Python path reads it. */
        if (describe && described_output(&record, result) < 0) {
            PyErr_WriteUnraisable(self->slow); /* the end is still written, without them */
            record.size = COMPACT_END_SIZE;
        }
        put_u64(record.data, span_id);
        put_u64(record.data + 8, (uint64_t)end);
        record.data[16] = 0; /* status: unset */
        if (write_record(writer, ring, record.size > COMPACT_END_SIZE ? ENCODING_ATTRIBUTED_END : ENCODING_COMPACT_END,
                         record.data, record.size) < 0)
            PyErr_WriteUnraisable(self->slow); /* never the kernel's result lost for its record */
        out_free(&record);
    }
    goto release;

fail:
    /* Recording met an error after the call was numbered: the kernel still
     * runs, unrecorded; KeyboardInterrupt and the like go to the caller. */
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_WriteUnraisable(self->slow);
        PyList_SetItem(state, 2, Py_NewRef(outer));
        then = self->function;
    }
    goto release;

slow:
    /* The Python path meets an ordinary error again, and says so. */
    if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        then = self->slow;
    }

release:
    out_free(&opening);
    Py_XDECREF(extra);
    Py_XDECREF(trace);
    if (call != NULL)
        in_flight_done(call);
    Py_DECREF(state);
    Py_DECREF(outer);
    Py_DECREF(writer);
    Py_DECREF(ring);
    return then != NULL ? PyObject_Vectorcall(then, args, nargsf, kwnames) : result;
}

static int recorded_init(Recorded *self, PyObject *args, PyObject *kwds) {
    PyObject *function, *slow, *site, *name, *replay = Py_None, *attributes = Py_None;
    long level;
    if (!PyArg_ParseTuple(args, "OOOUl|OO:Recorded", &function, &slow, &site, &name, &level, &replay, &attributes))
        return -1;
    if (attributes != Py_None && (!PyBytes_CheckExact(attributes) || PyBytes_GET_SIZE(attributes) > MAX_INLINE_EXTRA)) {
        PyErr_Format(PyExc_ValueError, "Recorded: a site's attributes are marshal data of at most %d bytes",
                     MAX_INLINE_EXTRA);
        return -1;
    }
    if (!PyCallable_Check(function) || !PyCallable_Check(slow) ||
        (replay != Py_None && (!PyTuple_Check(replay) || PyTuple_GET_SIZE(replay) != 3 ||
                               !PyUnicode_Check(PyTuple_GET_ITEM(replay, 0)) ||
                               !PyList_CheckExact(PyTuple_GET_ITEM(replay, 2))))) {
        PyErr_SetString(PyExc_TypeError, "Recorded(function, slow wrapper, site, name, level[, (graph attribute, "
                                         "replay context, [pending replay, output check]) for a graph's replay"
                                         "[, the site's attributes, marshalled]])");
        return -1;
    }
    Py_CLEAR(self->graph_attribute);
    Py_CLEAR(self->replay_context);
    Py_CLEAR(self->replays);
    Py_CLEAR(self->attributes);
    Py_CLEAR(self->attribute_pairs);
    if (attributes != Py_None && PyBytes_GET_SIZE(attributes)) {
        self->attributes = Py_NewRef(attributes);
        PyObject *dict = PyMarshal_ReadObjectFromString(PyBytes_AS_STRING(attributes), PyBytes_GET_SIZE(attributes));
        self->attribute_pairs = dict != NULL && PyDict_CheckExact(dict) ? dict_pairs(dict) : NULL;
        Py_XDECREF(dict);
        if (self->attribute_pairs == NULL) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "Recorded: a site's attributes are a marshalled dict");
            return -1;
        }
    }
    PyObject *skip_self = PyObject_GetAttr(site, str_skip_self);
    self->skip_self = skip_self != NULL && PyObject_IsTrue(skip_self) == 1;
    Py_XDECREF(skip_self);
    PyErr_Clear();
    if (replay != Py_None) {
        self->graph_attribute = Py_NewRef(PyTuple_GET_ITEM(replay, 0));
        self->replay_context = Py_NewRef(PyTuple_GET_ITEM(replay, 1));
        self->replays = Py_NewRef(PyTuple_GET_ITEM(replay, 2));
    }
    Py_XSETREF(self->function, Py_NewRef(function));
    Py_XSETREF(self->slow, Py_NewRef(slow));
    Py_XSETREF(self->site, Py_NewRef(site));
    Py_XSETREF(self->name, Py_NewRef(name));
    self->level = level;
    self->symbol_ring = 0;
    self->vectorcall = (vectorcallfunc)recorded_call;
    return 0;
}

static int recorded_traverse(Recorded *self, visitproc visit, void *arg) {
    Py_VISIT(self->function);
    Py_VISIT(self->slow);
    Py_VISIT(self->site);
    Py_VISIT(self->replay_context);
    Py_VISIT(self->replays);
    Py_VISIT(self->dict);
    return 0;
}

static int recorded_clear(Recorded *self) {
    Py_CLEAR(self->function);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->site);
    Py_CLEAR(self->name);
    Py_CLEAR(self->graph_attribute);
    Py_CLEAR(self->replay_context);
    Py_CLEAR(self->replays);
    Py_CLEAR(self->attributes);
    Py_CLEAR(self->attribute_pairs);
    Py_CLEAR(self->dict);
    return 0;
}

static void recorded_dealloc(Recorded *self) {
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    recorded_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A method of a class binds as a function does. */
static PyObject *recorded_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *recorded_repr(Recorded *self) {
    return PyUnicode_FromFormat("<recorded %R>", self->function ? self->function : Py_None);
}

/* Pickled by reference, as a function is: its module's attribute of its qualified name. */
static PyObject *recorded_reduce(PyObject *self, PyObject *unused) {
    return PyObject_GetAttrString(self, "__qualname__");
}

static PyMethodDef recorded_methods[] = {
    {"__reduce__", recorded_reduce, METH_NOARGS, NULL},
    {NULL}};

static PyGetSetDef recorded_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL}};

static PyTypeObject RecordedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sglang_otel_kernels._native.Recorded",
    .tp_basicsize = sizeof(Recorded),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "A decorated kernel entry point, recorded by the compiled core where it can be.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)recorded_init,
    .tp_dealloc = (destructor)recorded_dealloc,
    .tp_traverse = (traverseproc)recorded_traverse,
    .tp_clear = (inquiry)recorded_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Recorded, vectorcall),
    .tp_descr_get = recorded_get,
    .tp_dictoffset = offsetof(Recorded, dict),
    .tp_weaklistoffset = offsetof(Recorded, weakrefs),
    .tp_repr = (reprfunc)recorded_repr,
    .tp_getset = recorded_getset,
    .tp_methods = recorded_methods,
};

/* -- SIGTERM's line ---------------------------------------------------------
 * A process stopped on purpose must read as stopped, and still end as
 * SIGTERM ends it. faulthandler's dump of Python's stacks, run in the signal
 * handler, can itself crash (CPython gh-123967: a trampoline frame on top,
 * 3.12 before 3.12.8 and 3.13.0; other threads' frames freed under it): the
 * stop then ended as a SIGSEGV, and read as a crash. This handler writes one
 * fixed line to the traceback file, with write(2) alone, then does what SIGTERM
 * did before it: the default ends the process, an application's handler runs. */

static const char sigterm_line[] = "Stopped by SIGTERM\n";
static struct sigaction sigterm_before;
static volatile sig_atomic_t sigterm_fd = -1;

static void on_sigterm(int signum, siginfo_t *info, void *context) {
    int saved = errno;
    const char *p = sigterm_line;
    size_t left = sizeof(sigterm_line) - 1;
    int fd = sigterm_fd;
    while (fd >= 0 && left > 0) {
        ssize_t n = write(fd, p, left);
        if (n > 0)
            p += n, left -= (size_t)n;
        else if (n < 0 && errno == EINTR)
            continue;
        else
            break;
    }
    if (sigterm_before.sa_flags & SA_SIGINFO) {
        sigterm_before.sa_sigaction(signum, info, context);
    } else if (sigterm_before.sa_handler == SIG_DFL) {
        /* Blocked until this handler returns, then the default action: the process ends by SIGTERM. */
        sigaction(signum, &sigterm_before, NULL);
        raise(signum);
    } else if (sigterm_before.sa_handler != SIG_IGN) {
        sigterm_before.sa_handler(signum);
    }
    errno = saved;
}

/* mark_sigterm(fd): SIGTERM writes its line to `fd` from now on (True), unless
 * SIGTERM is ignored (False: nothing stops the process, nothing is said).
 * mark_sigterm(-1): the handler from before this one is put back, if this one
 * is still SIGTERM's (an application that set its own since keeps it). */
static PyObject *mark_sigterm(PyObject *module, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (fd < -1 || fd > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "mark_sigterm takes a file descriptor or -1, not %ld", fd);
        return NULL;
    }
    struct sigaction now;
    if (sigaction(SIGTERM, NULL, &now) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    int ours = (now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigterm;
    if (fd == -1) {
        sigterm_fd = -1;
        if (ours && sigaction(SIGTERM, &sigterm_before, NULL) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        Py_RETURN_FALSE;
    }
    if (!ours && !(now.sa_flags & SA_SIGINFO) && now.sa_handler == SIG_IGN)
        Py_RETURN_FALSE;
    sigterm_fd = (int)fd;
    if (!ours) {
        struct sigaction mine;
        memset(&mine, 0, sizeof(mine));
        sigemptyset(&mine.sa_mask);
        mine.sa_sigaction = on_sigterm;
        /* Restarting system calls or not, as before: Python's own handler wants them interrupted. */
        mine.sa_flags = SA_SIGINFO | SA_ONSTACK | (now.sa_flags & SA_RESTART);
        sigterm_before = now;
        if (sigaction(SIGTERM, &mine, NULL) != 0) {
            sigterm_fd = -1;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    Py_RETURN_TRUE;
}

/* -- module ------------------------------------------------------------------ */

static PyObject *crc32_py(PyObject *module, PyObject *arg) {
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    uint32_t crc = crc32_of(data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc);
}

/* -- a plain kernel call's Span, in OTLP's wire form ------------------------
 * For the sidecar (live/wire.py), which sends tens of thousands a second:
 * the same bytes as its twin, record/otlp_encode.py's `python_counter_span`. */

static unsigned char *put_varint(unsigned char *p, uint64_t value) {
    while (value >= 0x80) {
        *p++ = (unsigned char)(value | 0x80);
        value >>= 7;
    }
    *p++ = (unsigned char)value;
    return p;
}

static size_t varint_size(uint64_t value) {
    size_t size = 1;
    while (value >= 0x80) {
        value >>= 7;
        size++;
    }
    return size;
}

static unsigned char *put_big_endian(unsigned char *p, uint64_t value) {
    for (int shift = 56; shift >= 0; shift -= 8)
        *p++ = (unsigned char)(value >> shift);
    return p;
}

static PyObject *sixty_four;

/* An id or a time: an int from 0 to 2**64 - 1, else OverflowError / TypeError. */
static int unsigned_64(PyObject *value, uint64_t *out) {
    if (!PyLong_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "an int is needed");
        return -1;
    }
    *out = PyLong_AsUnsignedLongLong(value);
    return *out == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *counter_span(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "counter_span takes 10 arguments");
        return NULL;
    }
    uint64_t high, low, span_id, parent_id, start, end;
    if (!PyLong_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "an int is needed");
        return NULL;
    }
    PyObject *shifted = PyNumber_Rshift(args[0], sixty_four);
    if (shifted == NULL)
        return NULL;
    int bad = unsigned_64(shifted, &high); /* a negative id's high part is negative */
    Py_DECREF(shifted);
    if (bad)
        return NULL;
    low = PyLong_AsUnsignedLongLongMask(args[0]);
    if (unsigned_64(args[1], &span_id) || unsigned_64(args[2], &parent_id) || unsigned_64(args[4], &start) ||
        unsigned_64(args[5], &end))
        return NULL;
    if (!PyLong_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError, "the counter is an int");
        return NULL;
    }
    uint64_t counter = PyLong_AsUnsignedLongLongMask(args[8]); /* int64: two's complement */
    if (counter == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    PyObject *parts[4] = {args[3], args[6], args[7], args[9]}; /* name and kind, head, counter's key, tail */
    for (int i = 0; i < 4; i++)
        if (!PyBytes_Check(parts[i])) {
            PyErr_SetString(PyExc_TypeError, "the encoded parts are bytes");
            return NULL;
        }
    size_t name_kind = (size_t)PyBytes_GET_SIZE(parts[0]), head = (size_t)PyBytes_GET_SIZE(parts[1]);
    size_t key = (size_t)PyBytes_GET_SIZE(parts[2]), tail = (size_t)PyBytes_GET_SIZE(parts[3]);
    size_t value = 1 + varint_size(counter);               /* AnyValue: int_value */
    size_t pair = key + 1 + varint_size(value) + value;     /* KeyValue: the key, then the value */
    size_t attribute = 1 + varint_size(pair) + pair;
    size_t body = 2 + 16 + 2 + 8 + (parent_id ? 2 + 8 : 0) + name_kind + 9 + 9 + head + attribute + tail;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(1 + varint_size(body) + body));
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    *p++ = 0x12; /* ScopeSpans.spans */
    p = put_varint(p, body);
    *p++ = 0x0a, *p++ = 16;
    p = put_big_endian(put_big_endian(p, high), low);
    *p++ = 0x12, *p++ = 8;
    p = put_big_endian(p, span_id);
    if (parent_id) {
        *p++ = 0x22, *p++ = 8;
        p = put_big_endian(p, parent_id);
    }
    memcpy(p, PyBytes_AS_STRING(parts[0]), name_kind), p += name_kind;
    *p++ = 0x39; /* the times: fixed64, as the ring's integers (put_u64) */
    put_u64(p, start), p += 8;
    *p++ = 0x41;
    put_u64(p, end), p += 8;
    memcpy(p, PyBytes_AS_STRING(parts[1]), head), p += head;
    *p++ = 0x4a; /* Span.attributes */
    p = put_varint(p, pair);
    memcpy(p, PyBytes_AS_STRING(parts[2]), key), p += key;
    *p++ = 0x12; /* KeyValue.value */
    p = put_varint(p, value);
    *p++ = 0x18; /* AnyValue.int_value */
    p = put_varint(p, counter);
    memcpy(p, PyBytes_AS_STRING(parts[3]), tail);
    return out;
}

static PyMethodDef module_methods[] = {
    {"set_writer", (PyCFunction)(void (*)(void))set_writer, METH_FASTCALL, "The file records go to (writer, Ring), or (None, None)."},
    {"set_runtime", set_runtime, METH_VARARGS, "set_runtime(spans or None, bare_upto, span flags[, described_upto])"},
    {"set_describer", set_describer, METH_VARARGS,
     "set_describer(Tensor, Parameter, {dtype: name}, torch.strided, attribute prefix, "
     "add_described(attributes, path, value), encode): what describing arguments reads."},
    {"set_capturing", set_capturing, METH_O, "How many CUDA graphs are being captured."},
    {"setup", setup, METH_VARARGS, "The Python objects the core reads (record/core.py)."},
    {"seed", seed, METH_O, "Seeds the span and trace ids (32 bytes)."},
    {"set_batch", set_batch, METH_VARARGS,
     "set_batch(SpanContext, TraceFlags(SAMPLED), DEFAULT_TRACE_STATE, Context, the span's key, the batch's key, "
     "the kernel calls' attribute, end(span, time), failed(span, exception), detach_failed(exception)): "
     "what open_batch makes and calls."},
    {"open_batch", (PyCFunction)(void (*)(void))open_batch, METH_FASTCALL,
     "open_batch(span type, start, parent, trace id, current, batch, end_later): a BatchScope, or None."},
    {"prime_parent", prime_parent, METH_O, "prime_parent((context, trace id, parent id, flags)): parent_of's answer, told ahead."},
    {"next_seq", next_seq, METH_NOARGS, "The next call number, shared with the compiled wrappers."},
    {"recorded", recorded, METH_NOARGS, "How many calls this core recorded itself (the others went through Python)."},
#ifdef SOK_TIMING
    {"timing", timing, METH_NOARGS, "(calls, ns outside their kernels, ns batch spans took to close and end): SOK_TIMING's build only."},
#endif
    {"reset_seq", reset_seq, METH_NOARGS, "After fork, in the child: numbering anew."},
    {"crc32", crc32_py, METH_O, "CRC-32 as zlib.crc32 computes it (for the tests)."},
    {"counter_span", (PyCFunction)(void (*)(void))counter_span, METH_FASTCALL,
     "counter_span(trace_id, span_id, parent_id, name_and_kind, start, end, head, counter_key, counter, tail): "
     "a Span, encoded (record/otlp_encode.py)."},
    {"mark_sigterm", mark_sigterm, METH_O,
     "mark_sigterm(fd): SIGTERM writes one line to fd first (True; False while SIGTERM is ignored); -1: no more."},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_native", "The compiled recording core.", -1,
                                        module_methods};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    if (PyType_Ready(&RingType) < 0 || PyType_Ready(&RecordedType) < 0 || PyType_Ready(&InFlightType) < 0 ||
        PyType_Ready(&SpanRecordType) < 0 || PyType_Ready(&BatchScopeType) < 0)
        return NULL;
    str_state = PyUnicode_InternFromString("state");
    str_provider = PyUnicode_InternFromString("provider");
    str_processors = PyUnicode_InternFromString("_processors");
    str_symbols = PyUnicode_InternFromString("symbols");
    str_write_record = PyUnicode_InternFromString("write_record");
    str_flag = PyUnicode_InternFromString("_is_compiling_flag");
    str_attributes = PyUnicode_InternFromString("attributes");
    str_numbers = PyUnicode_InternFromString("numbers");
    if (!str_attributes || !str_numbers)
        return NULL;
    const char *names[] = {"shape", "dtype", "is_cpu", "device", "layout", "stride", "requires_grad",
                           "skip_self", "cpu", "None", "nan", "inf", "-inf", "name"};
    PyObject **strings[] = {&str_shape, &str_dtype, &str_is_cpu, &str_device, &str_layout, &str_stride,
                            &str_requires_grad, &str_skip_self, &str_cpu, &str_none, &str_nan,
                            &str_inf, &str_minus_inf, &str_name};
    for (size_t i = 0; i < sizeof(names) / sizeof(*names); i++)
        if ((*strings[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return NULL;
    one = PyLong_FromLong(1);
    sixty_four = PyLong_FromLong(64);
    str_span_processors = PyUnicode_InternFromString("_span_processors");
    str_seen = PyUnicode_InternFromString("_seen");
    str_targets = PyUnicode_InternFromString("_targets");
    if (!str_span_processors || !str_seen || !str_targets)
        return NULL;
    if (!one || !sixty_four || !str_state || !str_provider || !str_processors || !str_symbols || !str_write_record || !str_flag)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObject(module, "Ring", Py_NewRef((PyObject *)&RingType)) < 0 ||
        PyModule_AddObject(module, "Recorded", Py_NewRef((PyObject *)&RecordedType)) < 0 ||
        PyModule_AddObject(module, "SpanRecord", Py_NewRef((PyObject *)&SpanRecordType)) < 0 ||
        PyModule_AddObject(module, "BatchScope", Py_NewRef((PyObject *)&BatchScopeType)) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
