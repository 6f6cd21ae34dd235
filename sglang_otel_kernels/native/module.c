/* The module: its functions and types, made ready at import; record/recording.py
 * loads it, or the pure-Python path records where it is not built. */

static PyMethodDef module_methods[] = {
    {"set_writer", (PyCFunction)(void (*)(void))set_writer, METH_FASTCALL, "The file records go to (writer, Ring), or (None, None)."},
    {"set_runtime", set_runtime, METH_VARARGS, "set_runtime(spans or None, bare_upto, span flags[, described_upto])"},
    {"set_describer", set_describer, METH_VARARGS,
     "set_describer(Tensor, Parameter, {dtype: name}, torch.strided, attribute prefix, "
     "add_described(attributes, path, value), encode): what describing arguments reads."},
    {"set_capturing", set_capturing, METH_O, "How many CUDA graphs are being captured."},
    {"set_nan_flags", set_nan_flags, METH_VARARGS,
     "set_nan_flags(after, before, wanted), each a callable or None: before(call, seq, arguments, keyword names, "
     "wrapper) before each call this core records runs where wanted(kernel name) (asked once a site) is true, "
     "after(call, seq, result, wrapper, what before gave) once it returned."},
    {"setup", setup, METH_VARARGS, "The Python objects the core reads (record/recording.py)."},
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
    {"finite_rows", (PyCFunction)(void (*)(void))finite_rows, METH_FASTCALL,
     "finite_rows(source, count, kind, rows, destination): a byte a row of a CPU tensor's memory, 1 when all finite."},
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
