/* A call in flight, as the Python side reads it while the call runs; its
 * Python twin is the tuple record/spans.py makes (TRACE_ID ... CALL_SEQ). */

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
