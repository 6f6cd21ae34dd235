/* The NaN flags of a CPU tensor (capture/nan_flags.py): whether each row of
 * its memory is all finite, one byte a row, written where the caller says.
 * Its Python twin is describe/statistics.py `finite_rows`'s torch path, which
 * an accelerator's tensors (and a CPU tensor this does not take) go through:
 * a CPU tensor's values are in host memory, so scanning them here reads
 * nothing back from a device, and costs no torch dispatch (four of them, 2
 * to 3 us each, were most of what the flags cost a call on SGLang's server). */

/* An element is not finite when its exponent bits are all set (NaN and both
 * Infs): `~value & mask` is then 0, so a row is all finite when the least of
 * those is not 0. A minimum over a row vectorises (gcc's -O3). */
#if defined(__GNUC__) && !defined(__clang__)
#define VECTORISED __attribute__((optimize("O3")))
#else
#define VECTORISED
#endif
#define LEAST_MASKED(type, row, count, mask)                                         \
    do {                                                                             \
        const type *v = (const type *)(row);                                         \
        type least = (mask);                                                         \
        for (Py_ssize_t i = 0; i < (count); i++) {                                   \
            type masked = (type)(~v[i] & (mask));                                    \
            least = masked < least ? masked : least;                                 \
        }                                                                            \
        return least != 0;                                                           \
    } while (0)

static VECTORISED int finite_row(const unsigned char *row, Py_ssize_t count, int kind) {
    switch (kind) {
    case 2: /* float16 */
        LEAST_MASKED(uint16_t, row, count, 0x7c00u);
    case 3: /* bfloat16 */
        LEAST_MASKED(uint16_t, row, count, 0x7f80u);
    case 4: /* float32 */
        LEAST_MASKED(uint32_t, row, count, 0x7f800000u);
    default: /* float64 */
        LEAST_MASKED(uint64_t, row, count, 0x7ff0000000000000ull);
    }
}

/* finite_rows(source, count, kind, rows, destination): `count` elements of
 * `kind` (2 float16, 3 bfloat16, 4 float32, 8 float64) at address `source`,
 * contiguous, in `rows` rows of count / rows; a byte a row at `destination`. */
static PyObject *finite_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "finite_rows(source, count, kind, rows, destination)");
        return NULL;
    }
    unsigned long long source = PyLong_AsUnsignedLongLong(args[0]);
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    long kind = PyLong_AsLong(args[2]);
    Py_ssize_t rows = PyLong_AsSsize_t(args[3]);
    unsigned long long destination = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (source == 0 || destination == 0 || count < 0 || rows <= 0 || count % rows != 0 ||
        (kind != 2 && kind != 3 && kind != 4 && kind != 8)) {
        PyErr_SetString(PyExc_ValueError, "finite_rows: bad address, count, rows or kind");
        return NULL;
    }
    Py_ssize_t each = count / rows, size = kind == 3 ? 2 : kind;
    const unsigned char *from = (const unsigned char *)(uintptr_t)source;
    unsigned char *to = (unsigned char *)(uintptr_t)destination;
    for (Py_ssize_t row = 0; row < rows; row++)
        to[row] = (unsigned char)finite_row(from + row * each * size, each, (int)kind);
    Py_RETURN_NONE;
}
