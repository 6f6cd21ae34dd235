/* The recorded call: the hot path of a decorated kernel call (its span's
 * records around the kernel, a CUDA graph's replay); its Python twin is
 * capture/decorator.py's wrapper with record/spans.py. */

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

/* The NaN flags of a call's arguments queued before it runs (recording.flag_before), where its kernel's
 * name is one they are asked for (asked once a site and setting): what it gives, for flag_after; None when
 * they are off or it failed (said, the call goes on); NULL with KeyboardInterrupt and the like set, which
 * the call meets as if its kernel raised them. */
static PyObject *flag_inputs(Recorded *self, InFlight *call, unsigned long long seq, PyObject *const *args,
                             size_t nargsf, PyObject *kwnames) {
    if (recording.flag_before == NULL)
        Py_RETURN_NONE;
    if (self->inputs_asked_in != recording.nan_setting) {
        PyObject *wanted = PyObject_CallOneArg(recording.inputs_wanted, self->name);
        int yes = wanted != NULL ? PyObject_IsTrue(wanted) : -1;
        Py_XDECREF(wanted);
        if (yes < 0) {
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return NULL;
            PyErr_WriteUnraisable(self->slow); /* unflagged, asked again next call */
            Py_RETURN_NONE;
        }
        self->inputs_wanted = yes;
        self->inputs_asked_in = recording.nan_setting;
    }
    if (!self->inputs_wanted)
        Py_RETURN_NONE;
    Py_ssize_t count = PyVectorcall_NARGS(nargsf) + (kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *values = PyTuple_New(count), *number = PyLong_FromUnsignedLongLong(seq), *done = NULL;
    if (values != NULL && number != NULL) {
        for (Py_ssize_t at = 0; at < count; at++)
            PyTuple_SET_ITEM(values, at, Py_NewRef(args[at]));
        done = PyObject_CallFunctionObjArgs(recording.flag_before, (PyObject *)call, number, values,
                                            kwnames != NULL ? kwnames : Py_None, self->slow, NULL);
    }
    Py_XDECREF(values);
    Py_XDECREF(number);
    if (done == NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_WriteUnraisable(self->slow); /* never the kernel's call lost for its flags */
        done = Py_NewRef(Py_None);
    }
    return done;
}

static PyObject *RECORDED_CALL(Recorded *self, PyObject *const *args, size_t nargsf, PyObject *kwnames TIMED_PARAMETER) {
    if (compiling())
        return PyObject_Vectorcall(self->function, args, nargsf, kwnames);
    int describe = self->level > recording.bare_upto; /* its arguments too */
    if (recording.capturing ||
        (describe && (self->level > recording.described_upto || self->replays != NULL || describer.add_described == NULL)) ||
        recording.ring == NULL || recording.ring->inline_end < 0 || !spans_ready())
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
    if (!PyList_CheckExact(state) || PyList_GET_SIZE(state) != 4 || PyList_GET_ITEM(state, 0) != recording.writer) {
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
        symbol = recording.ring == NULL || recording.ring->inline_end < 0 ? 0 : site_symbol(self);
        if (symbol == 0 || PyList_GET_ITEM(state, 0) != recording.writer) {
            Py_DECREF(state);
            out_free(&opening);
            return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
        }
    }
    PyObject *outer = Py_NewRef(PyList_GET_ITEM(state, 2));
    PyObject *writer = Py_NewRef(recording.writer);
    Ring *ring = (Ring *)Py_NewRef((PyObject *)recording.ring);
    PyObject *trace = NULL, *result = NULL, *inputs = NULL;
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
        flags = recording.parent_flags;
        parent_id = recording.parent_id;
        if (parent_id) {
            hi = recording.trace_hi;
            lo = recording.trace_lo;
            trace = Py_NewRef(recording.last_trace);
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
    flags |= recording.span_flags | kind_flags;
    uint64_t span_id = random_span_id();
    if (!kind_flags)
        seq = ++recording.seq;
    recording.recorded++;
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

    if (!kind_flags)
        inputs = flag_inputs(self, call, seq, args, nargsf, kwnames);
    if (kind_flags || inputs != NULL) {
        KERNEL_BEGINS();
        result = PyObject_Vectorcall(self->function, args, nargsf, kwnames);
        KERNEL_ENDED();
    }

    PyList_SetItem(state, 2, Py_NewRef(outer));
    if (result == NULL) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (traceback != NULL && value != NULL)
            PyException_SetTraceback(value, traceback);
        PyObject *done = PyObject_CallFunctionObjArgs(recording.failed, self->site, (PyObject *)call,
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
        if (recording.flag_after != NULL && !kind_flags) { /* the NaN flags: its outputs' queued on their device */
            PyObject *number = PyLong_FromUnsignedLongLong(seq);
            PyObject *done = number != NULL ? PyObject_CallFunctionObjArgs(recording.flag_after, (PyObject *)call,
                                                                            number, result, self->slow,
                                                                            inputs != NULL ? inputs : Py_None, NULL)
                                            : NULL;
            Py_XDECREF(number);
            if (done == NULL) {
                if (PyErr_ExceptionMatches(PyExc_Exception))
                    PyErr_WriteUnraisable(self->slow); /* never the kernel's result lost for its flags */
                else
                    Py_CLEAR(result); /* KeyboardInterrupt and the like go to the caller, as in Python */
            }
            Py_XDECREF(done);
        }
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
    Py_XDECREF(inputs);
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
