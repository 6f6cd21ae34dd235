/* A trace file's ring as this core writes it; its Python twin is
 * record/tracefile.py's TraceFileWriter (write_record). */

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
