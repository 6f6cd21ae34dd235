/* A serving engine's batch span, started, attached and ended here; its
 * Python twin is record/file_spans.py's FileSpan with capture/requests.py's
 * forward_batch. */

/* -- batch spans ------------------------------------------------------------ */

/* A serving engine opens a batch span every step (record/file_spans.py's
 * FileSpan, written straight into the trace file): here its start, its
 * context attached and its end are one call each, where Python took a dozen
 * frames, each cold after the engine's own step (about 40 us a step on
 * SGLang's real server). Anything unusual goes through Python: an end with
 * events or a description, a file this core does not write, a failure. */


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
    if (recording.writer == NULL)
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
                done = write_record(recording.writer, recording.ring, extra ? ENCODING_ATTRIBUTED_END : ENCODING_COMPACT_END,
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
    if (PyContextVar_Reset(recording.context_var, token) < 0) {
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
    if (batch.context == NULL || recording.context_var == NULL || recording.writer == NULL ||
        recording.ring == NULL || recording.ring->inline_end < 0)
        Py_RETURN_NONE;
    PyObject *start = args[1], *parent = args[2], *trace_id = args[3], *current = args[4];
    PyObject *state = thread_state();
    if (state == NULL)
        return NULL;
    if (!PyList_CheckExact(state) || PyList_GET_SIZE(state) != 4 || PyList_GET_ITEM(state, 0) != recording.writer) {
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
    if (write_record(recording.writer, recording.ring, ENCODING_SPAN_START, record, SPAN_START_SIZE + size) < 0)
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
    if ((token = PyContextVar_Set(recording.context_var, published)) == NULL)
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
