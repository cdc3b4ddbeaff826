/* LZF decompression (the format of liblzf, which redis uses for RDB strings), in C.
 *
 * `expand(src, dst)` decodes the LZF stream `src` (any bytes-like object) into `dst` (a
 * writable buffer: a bytearray, or a reserved block of the arena) and returns how many
 * bytes it wrote; ValueError when the stream is malformed or would not fit in `dst`.
 * It holds no Python object while it runs, so it releases the GIL: a caller in a worker
 * thread leaves the event loop free (quilld/protocol/commands/rdb_payload.py).
 *
 * The stream is a sequence of items, each starting with a control byte c:
 *   c < 32:  a literal run of c + 1 bytes, copied as they are;
 *   else:    a back reference: length L = c >> 5 (7: plus the next byte) + 2, distance
 *            D = ((c & 31) << 8 | the next byte) + 1; the L bytes that start D bytes
 *            before the end of the output so far are appended (they may overlap what
 *            is being appended: D < L repeats the last D bytes).
 * Every read and write is bounds-checked before it is made.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* Bytes written, or -1 when the stream is malformed or does not fit in `out_len`. */
static Py_ssize_t
lzf_expand(const unsigned char *ip, size_t in_len, unsigned char *out, size_t out_len)
{
    const unsigned char *in_end = ip + in_len;
    unsigned char *op = out, *out_end = out + out_len;

    while (ip < in_end) {
        size_t ctrl = *ip++;
        if (ctrl < 32) {
            size_t run = ctrl + 1;
            if ((size_t)(in_end - ip) < run || (size_t)(out_end - op) < run)
                return -1;
            memcpy(op, ip, run);
            op += run;
            ip += run;
            continue;
        }
        size_t len = ctrl >> 5;
        if (len == 7) {
            if (ip >= in_end)
                return -1;
            len += *ip++;
        }
        if (ip >= in_end)
            return -1;
        size_t dist = ((ctrl & 31) << 8) + *ip++ + 1;
        len += 2;
        if ((size_t)(op - out) < dist || (size_t)(out_end - op) < len)
            return -1;
        const unsigned char *ref = op - dist;
        /* An overlapping reference repeats a pattern of `dist` bytes: copy it in chunks that
         * never overlap, each as long as all that is written from `ref` so far. */
        while (len) {
            size_t n = (size_t)(op - ref);
            if (n > len)
                n = len;
            memcpy(op, ref, n);
            op += n;
            len -= n;
        }
    }
    return (Py_ssize_t)(op - out);
}

static PyObject *
expand(PyObject *self, PyObject *args)
{
    Py_buffer src, dst;
    Py_ssize_t written;

    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*:expand", &src, &dst))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    written = lzf_expand(src.buf, (size_t)src.len, dst.buf, (size_t)dst.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (written < 0) {
        PyErr_SetString(PyExc_ValueError, "malformed LZF data, or longer than its buffer");
        return NULL;
    }
    return PyLong_FromSsize_t(written);
}

static PyMethodDef methods[] = {
    {"expand", expand, METH_VARARGS,
     "expand(src, dst) -> int: decode the LZF stream src into the writable buffer dst (GIL released);\n"
     "the number of bytes written, or ValueError when src is malformed or does not fit in dst."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "quilld._lzf", "LZF decompression in C (see _lzf.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__lzf(void)
{
    return PyModule_Create(&module);
}
