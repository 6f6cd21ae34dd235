/* A decorated function as this core records it (`Recorded`), and what its
 * calls read: whether spans are ready, the site's symbol, the parent span,
 * a record written; its Python twin is capture/decorator.py's KernelSite
 * with record/spans.py. */

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
    /* Whether the NaN flags flag its arguments (recording.inputs_wanted's answer), for the setting it was
     * asked in (recording.nan_setting; 0: not asked). */
    unsigned long long inputs_asked_in;
    int inputs_wanted;
    PyObject *dict;
    PyObject *weakrefs;
} Recorded;

static int compiling(void) {
    if (recording.compiler != NULL) { /* torch.compiler's namespace: its flag, read as is_compiling() reads it */
        PyObject *flag = PyDict_GetItemWithError(recording.compiler, str_flag);
        if (flag == NULL)
            PyErr_Clear();
        return flag == Py_True;
    }
    if (recording.is_compiling == NULL)
        return 0;
    PyObject *flag = PyObject_CallNoArgs(recording.is_compiling);
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
    if (recording.spans_ready == 1)
        return 1;
    if (recording.spans == NULL)
        return 0;
    if (recording.spans_ready == 2) {
        PyObject *present = PyObject_GetAttr(recording.processors, str_span_processors);
        if (present == NULL) {
            PyErr_Clear();
            return 0;
        }
        int same = present == recording.seen;
        if (!same) {
            /* Changed since: fast again once Python has looked at them and found no other. */
            PyObject *seen = PyObject_GetAttr(recording.spans, str_seen);
            PyObject *targets = seen != NULL ? PyObject_GetAttr(recording.spans, str_targets) : NULL;
            if (seen == present && targets == Py_None) {
                Py_XSETREF(recording.seen, Py_NewRef(present));
                same = 1;
            }
            Py_XDECREF(seen);
            Py_XDECREF(targets);
            PyErr_Clear();
        }
        Py_DECREF(present);
        return same;
    }
    PyObject *provider = PyObject_GetAttr(recording.spans, str_provider);
    if (provider == NULL) {
        PyErr_Clear();
        return 0;
    }
    int set_up = provider != Py_None;
    Py_DECREF(provider);
    if (!set_up)
        return 0;
    PyObject *processors = PyObject_GetAttr(recording.spans, str_processors);
    if (processors == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (processors == Py_None) {
        recording.spans_ready = 1;
        Py_DECREF(processors);
        return 1;
    }
    Py_XSETREF(recording.processors, processors);
    Py_CLEAR(recording.seen);
    recording.spans_ready = 2;
    return 0;
}

/* This site's name as a symbol of the current ring: 0 when Python must
 * write it first (or cannot: the table is full, and the name goes inline). */
static unsigned long site_symbol(Recorded *self) {
    if (self->symbol_ring == recording.ring->id)
        return self->symbol;
    PyObject *symbols = PyObject_GetAttr(recording.writer, str_symbols);
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
        self->symbol_ring = recording.ring->id;
        self->symbol = symbol;
        return symbol;
    }
    return 0;
}

/* The parent root calls in `context` take: span `parent_id` (0: none, each
 * call starts a trace) of trace `trace` (`hi`, `lo`), with `flags`. */
static void keep_parent(PyObject *context, PyObject *trace, uint64_t hi, uint64_t lo, uint64_t parent_id,
                        unsigned flags) {
    Py_XSETREF(recording.last_context, Py_NewRef(context));
    Py_XSETREF(recording.last_trace, parent_id ? Py_NewRef(trace) : NULL);
    recording.trace_hi = hi;
    recording.trace_lo = lo;
    recording.parent_id = parent_id;
    recording.parent_flags = flags;
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
    if (recording.context_var != NULL) {
        if (PyContextVar_Get(recording.context_var, NULL, &context) < 0)
            return -1;
        if (context == NULL)
            context = Py_NewRef(Py_None);
    } else {
        context = PyObject_CallNoArgs(recording.get_current);
        if (context == NULL)
            return -1;
    }
    if (context == recording.last_context) {
        Py_DECREF(context);
        return 0;
    }
    PyObject *parent = PyObject_CallOneArg(recording.parent_of, context);
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
