/* The sidecar's encoding of a plain kernel call; its Python twin is
 * record/otlp_encode.py's python_counter_span. */

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
