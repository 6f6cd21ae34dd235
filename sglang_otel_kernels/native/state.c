/* What the Python side sets (the writer, the runtime, the describer),
 * the clock and the ids: this core's state; its Python twins are
 * record/recording.py (which sets it) and record/spans.py's ids and clock. */

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
    /* The NaN flags (capture/nan_flags.py), or NULL: flag_before (call, seq, arguments, keyword names,
     * wrapper) -> what flag_after is given last, before a call this core records runs (its inputs' flags)
     * where inputs_wanted (kernel name) -> bool said so, asked once a site for each nan_setting (a count of
     * set_nan_flags calls, which the patterns change with); flag_after (call, seq, result, wrapper, that) ->
     * None after it returned (its outputs'). */
    PyObject *flag_before;
    PyObject *inputs_wanted;
    unsigned long long nan_setting;
    PyObject *flag_after;
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
} recording = {.bare_upto = -1, .described_upto = -1};

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
    uint64_t *s = recording.random;
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
    Py_CLEAR(recording.writer);
    Py_CLEAR(recording.ring);
    if (args[0] != Py_None && args[1] != Py_None) {
        recording.writer = Py_NewRef(args[0]);
        recording.ring = (Ring *)Py_NewRef(args[1]);
    }
    Py_RETURN_NONE;
}

static PyObject *set_runtime(PyObject *module, PyObject *args) {
    PyObject *spans;
    long bare_upto, described_upto = -1;
    unsigned int flags;
    if (!PyArg_ParseTuple(args, "OlI|l:set_runtime", &spans, &bare_upto, &flags, &described_upto))
        return NULL;
    Py_CLEAR(recording.spans);
    if (spans != Py_None)
        recording.spans = Py_NewRef(spans);
    recording.spans_ready = 0;
    Py_CLEAR(recording.processors);
    Py_CLEAR(recording.seen);
    recording.bare_upto = spans == Py_None ? -1 : bare_upto;
    recording.described_upto = spans == Py_None ? -1 : described_upto;
    recording.span_flags = flags;
    Py_RETURN_NONE;
}

static PyObject *set_nan_flags(PyObject *module, PyObject *args) {
    PyObject *after, *before, *wanted;
    if (!PyArg_ParseTuple(args, "OOO:set_nan_flags", &after, &before, &wanted))
        return NULL;
    if ((after != Py_None && !PyCallable_Check(after)) || (before != Py_None && !PyCallable_Check(before)) ||
        (before != Py_None && !PyCallable_Check(wanted))) {
        PyErr_SetString(PyExc_TypeError, "set_nan_flags takes callables or None (`wanted` with `before`)");
        return NULL;
    }
    Py_XSETREF(recording.flag_after, after == Py_None ? NULL : Py_NewRef(after));
    Py_XSETREF(recording.flag_before, before == Py_None ? NULL : Py_NewRef(before));
    Py_XSETREF(recording.inputs_wanted, before == Py_None ? NULL : Py_NewRef(wanted));
    recording.nan_setting++;
    Py_RETURN_NONE;
}

static PyObject *set_capturing(PyObject *module, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    recording.capturing = (int)n;
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
    PyObject *state = PyObject_GetAttr(recording.per_thread, str_state);
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
    Py_XSETREF(recording.per_thread, Py_NewRef(per_thread));
    Py_CLEAR(state_of_owner); /* another object's states */
    Py_XSETREF(recording.context_var, context_var == Py_None ? NULL : Py_NewRef(context_var));
    Py_XSETREF(recording.get_current, Py_NewRef(get_current));
    Py_XSETREF(recording.parent_of, Py_NewRef(parent_of));
    Py_XSETREF(recording.failed, Py_NewRef(failed));
    if (compiler != Py_None && !PyDict_Check(compiler)) {
        PyErr_SetString(PyExc_TypeError, "setup: torch.compiler's namespace (a dict) or None");
        return NULL;
    }
    Py_XSETREF(recording.compiler, compiler == Py_None ? NULL : Py_NewRef(compiler));
    Py_XSETREF(recording.is_compiling, Py_NewRef(is_compiling));
    Py_RETURN_NONE;
}

static PyObject *seed(PyObject *module, PyObject *arg) {
    Py_buffer bytes;
    if (PyObject_GetBuffer(arg, &bytes, PyBUF_SIMPLE) < 0)
        return NULL;
    if (bytes.len != sizeof(recording.random)) {
        PyBuffer_Release(&bytes);
        PyErr_SetString(PyExc_ValueError, "seed takes 32 bytes");
        return NULL;
    }
    memcpy(recording.random, bytes.buf, sizeof(recording.random));
    PyBuffer_Release(&bytes);
    if (!(recording.random[0] | recording.random[1] | recording.random[2] | recording.random[3]))
        recording.random[0] = 1;
    Py_RETURN_NONE;
}

static PyObject *next_seq(PyObject *module, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(++recording.seq);
}

static PyObject *recorded(PyObject *module, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(recording.recorded);
}

static PyObject *reset_seq(PyObject *module, PyObject *unused) {
    recording.seq = 0;
    Py_CLEAR(recording.last_context);
    Py_CLEAR(recording.last_trace);
    Py_RETURN_NONE;
}
