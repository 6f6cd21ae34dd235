/* The line a SIGTERM leaves beside the trace file; its Python twin is
 * record/setup.py's handler where this core is not built. */

/* -- SIGTERM's line ---------------------------------------------------------
 * A process stopped on purpose must read as stopped, and still end as
 * SIGTERM ends it. faulthandler's dump of Python's stacks, run in the signal
 * handler, can itself crash (CPython gh-123967: a trampoline frame on top,
 * 3.12 before 3.12.8 and 3.13.0; other threads' frames freed under it): the
 * stop then ended as a SIGSEGV, and read as a crash. This handler writes one
 * fixed line to the traceback file, with write(2) alone, then does what SIGTERM
 * did before it: the default ends the process, an application's handler runs. */

static const char sigterm_line[] = "Stopped by SIGTERM\n";
static struct sigaction sigterm_before;
static volatile sig_atomic_t sigterm_fd = -1;

static void on_sigterm(int signum, siginfo_t *info, void *context) {
    int saved = errno;
    const char *p = sigterm_line;
    size_t left = sizeof(sigterm_line) - 1;
    int fd = sigterm_fd;
    while (fd >= 0 && left > 0) {
        ssize_t n = write(fd, p, left);
        if (n > 0)
            p += n, left -= (size_t)n;
        else if (n < 0 && errno == EINTR)
            continue;
        else
            break;
    }
    if (sigterm_before.sa_flags & SA_SIGINFO) {
        sigterm_before.sa_sigaction(signum, info, context);
    } else if (sigterm_before.sa_handler == SIG_DFL) {
        /* Blocked until this handler returns, then the default action: the process ends by SIGTERM. */
        sigaction(signum, &sigterm_before, NULL);
        raise(signum);
    } else if (sigterm_before.sa_handler != SIG_IGN) {
        sigterm_before.sa_handler(signum);
    }
    errno = saved;
}

/* mark_sigterm(fd): SIGTERM writes its line to `fd` from now on (True), unless
 * SIGTERM is ignored (False: nothing stops the process, nothing is said).
 * mark_sigterm(-1): the handler from before this one is put back, if this one
 * is still SIGTERM's (an application that set its own since keeps it). */
static PyObject *mark_sigterm(PyObject *module, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (fd < -1 || fd > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "mark_sigterm takes a file descriptor or -1, not %ld", fd);
        return NULL;
    }
    struct sigaction now;
    if (sigaction(SIGTERM, NULL, &now) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    int ours = (now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigterm;
    if (fd == -1) {
        sigterm_fd = -1;
        if (ours && sigaction(SIGTERM, &sigterm_before, NULL) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        Py_RETURN_FALSE;
    }
    if (!ours && !(now.sa_flags & SA_SIGINFO) && now.sa_handler == SIG_IGN)
        Py_RETURN_FALSE;
    sigterm_fd = (int)fd;
    if (!ours) {
        struct sigaction mine;
        memset(&mine, 0, sizeof(mine));
        sigemptyset(&mine.sa_mask);
        mine.sa_sigaction = on_sigterm;
        /* Restarting system calls or not, as before: Python's own handler wants them interrupted. */
        mine.sa_flags = SA_SIGINFO | SA_ONSTACK | (now.sa_flags & SA_RESTART);
        sigterm_before = now;
        if (sigaction(SIGTERM, &mine, NULL) != 0) {
            sigterm_fd = -1;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    Py_RETURN_TRUE;
}
