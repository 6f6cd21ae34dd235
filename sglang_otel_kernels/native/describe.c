/* Describing a call's arguments and result (level 3) straight into a
 * record's marshal data; its Python twins are describe/values.py and
 * describe/tensors.py (the tree) and record/attributes.py (its attributes). */

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
