/*
 * hicache.memory._spancopy: copy many byte spans between two buffers in one call, GIL released.
 *
 * Why native code: a scattered layer-wise load is thousands of 128-256 KiB pieces. Copied with
 * ordinary stores (memcpy, np.copyto, Tensor.copy_) every destination line is first read into
 * the cache (read-for-ownership), so each byte costs three memory transfers instead of two, and
 * one thread moves about 0.6x what a contiguous two-thread torch copy moves. Non-temporal
 * (streaming) stores skip that read: one thread then matches the contiguous copy. glibc only
 * streams copies larger than a big threshold (a sizeable fraction of the L3 cache), so per-piece
 * memcpy never does.
 *
 * Safety: every span is checked against both buffers (with the shifts applied) before anything
 * is copied; a bad span raises ValueError and copies nothing. The buffers are held (Py_buffer)
 * for the whole call, so their memory cannot be freed under the copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define HICACHE_X86 1
#include <immintrin.h>
#endif

/* Spans shorter than this are copied with memcpy even when streaming: the aligned head/tail copies
 * cost more than the cache traffic saved (the store fence is once per call). Streaming pays from
 * a few cache lines on: a page read into a strided SGLang host pool (2 KiB or 256 B runs) is
 * scattered 1.4-1.6x faster with streaming stores than with memcpy (measured on a 2-core box). */
#define STREAM_MIN_SPAN 128

typedef void (*copy_fn)(char *dst, const char *src, size_t n);

static void copy_plain(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }

#ifdef HICACHE_X86
/* One streaming copy per vector width: plain copies up to the first W-aligned destination byte,
 * then four unaligned W-byte loads and four aligned streaming stores per step, then the tail. */
#define STREAM_COPY(NAME, ATTR, W, VEC, LOAD, STREAM)                                  \
    ATTR static void NAME(char *dst, const char *src, size_t n) {                      \
        size_t head = (W - ((uintptr_t)dst & (W - 1))) & (W - 1);                      \
        if (head > n) head = n;                                                        \
        memcpy(dst, src, head);                                                        \
        dst += head; src += head; n -= head;                                           \
        size_t body = n & ~(size_t)(4 * W - 1);                                        \
        for (size_t i = 0; i < body; i += 4 * W) {                                     \
            VEC a = LOAD((const VEC *)(src + i));                                      \
            VEC b = LOAD((const VEC *)(src + i + W));                                  \
            VEC c = LOAD((const VEC *)(src + i + 2 * W));                              \
            VEC d = LOAD((const VEC *)(src + i + 3 * W));                              \
            STREAM((VEC *)(dst + i), a);                                               \
            STREAM((VEC *)(dst + i + W), b);                                           \
            STREAM((VEC *)(dst + i + 2 * W), c);                                       \
            STREAM((VEC *)(dst + i + 3 * W), d);                                       \
        }                                                                              \
        memcpy(dst + body, src + body, n - body);                                      \
    }

/* 16-byte SSE2 stores: every x86-64 CPU has them */
STREAM_COPY(copy_stream_sse2, , 16, __m128i, _mm_loadu_si128, _mm_stream_si128)
/* 32-byte AVX2 stores: compiled for AVX2 here only, chosen at import where the CPU has it */
STREAM_COPY(copy_stream_avx2, __attribute__((target("avx2"))), 32, __m256i, _mm256_loadu_si256,
            _mm256_stream_si256)
#endif

static copy_fn copy_stream = copy_plain;
static const char *stream_kind = "none";

typedef struct {
    int64_t dst, src, n;
} span_t;

/* a + b, or -1 if it overflows int64 (checked before adding: signed overflow is undefined) */
static int add_i64(int64_t a, int64_t b, int64_t *out) {
    if ((b > 0 && a > INT64_MAX - b) || (b < 0 && a < INT64_MIN - b)) return -1;
    *out = a + b;
    return 0;
}

/* whether a buffer format describes native 8-byte signed integers ("q", or "l" where long is 8) */
static int is_native_int64(const char *fmt, Py_ssize_t itemsize) {
    if (fmt == NULL || itemsize != 8) return 0;
    if (*fmt == '@' || *fmt == '=') fmt++;
#if PY_LITTLE_ENDIAN
    else if (*fmt == '<') fmt++;
#endif
    return (fmt[0] == 'q' || fmt[0] == 'l') && fmt[1] == '\0';
}

/* Whether a buffer format names Python objects ('O' anywhere: a struct may embed one). */
static int holds_objects(const char *fmt) {
    return fmt != NULL && strchr(fmt, 'O') != NULL;
}

PyDoc_STRVAR(copy_spans_doc,
"copy_spans(dst, src, spans, dst_shift=0, src_shift=0, streaming=False) -> int\n\n"
"For each row (d, s, n) of ``spans`` (a C-contiguous native int64 buffer of n rows of 3, or of\n"
"3n values), copy ``n`` bytes from ``src[s + src_shift:]`` to ``dst[d + dst_shift:]``. ``dst``\n"
"is a writable buffer, ``src`` any buffer. Every span is bounds-checked first and copied from a\n"
"private snapshot of the table, so a table that changes during the copy cannot redirect it; a\n"
"bad span, or rows of other than 3 values, raises ValueError and nothing is copied.\n"
"``streaming`` uses non-temporal stores for spans of 128 bytes and more (copies whose\n"
"destination is not read again soon). The GIL is released while copying. Returns the bytes\n"
"copied.");

static PyObject *copy_spans(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"dst", "src", "spans", "dst_shift", "src_shift", "streaming", NULL};
    Py_buffer dst, src, spans;
    PyObject *dst_obj, *src_obj, *spans_obj;
    long long dst_shift = 0, src_shift = 0;
    int streaming = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|LLp:copy_spans", keywords, &dst_obj, &src_obj,
                                     &spans_obj, &dst_shift, &src_shift, &streaming))
        return NULL;
    PyObject *result = NULL;
    span_t *rows = NULL;
    int have_dst = 0, have_src = 0, have_spans = 0;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto done;
    have_dst = 1;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto done;
    have_src = 1;
    /* bytes copied over object pointers (a numpy object array) corrupt the interpreter */
    if (holds_objects(dst.format) || holds_objects(src.format)) {
        PyErr_SetString(PyExc_TypeError, "copy_spans copies raw bytes: buffers of Python objects are refused");
        goto done;
    }
    if (PyObject_GetBuffer(spans_obj, &spans, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto done;
    have_spans = 1;
    if (!is_native_int64(spans.format, spans.itemsize)) {
        PyErr_Format(PyExc_TypeError, "spans must hold native int64 values, not format '%s' of %zd bytes",
                     spans.format ? spans.format : "B", spans.itemsize);
        goto done;
    }
    /* a table of rows (n, k) must have k == 3: a (3, 4) table holds 96 bytes, a whole number of
     * 24-byte rows, and was read as four rows it does not hold (bytes copied from and to where
     * the caller never said). A flat (3n,) table is rows of 3 in order. */
    if (spans.ndim >= 2 && spans.shape != NULL && spans.shape[spans.ndim - 1] != 3) {
        PyErr_Format(PyExc_ValueError,
                     "spans must be rows of 3 int64 values (dst, src, nbytes), not rows of %zd; "
                     "nothing was copied",
                     spans.shape[spans.ndim - 1]);
        goto done;
    }
    const Py_ssize_t row = (Py_ssize_t)sizeof(span_t);
    if (spans.len % row != 0) {
        PyErr_Format(PyExc_ValueError, "spans holds %zd bytes, not a whole number of (dst, src, nbytes) int64 rows",
                     spans.len);
        goto done;
    }
    const Py_ssize_t count = spans.len / row;
    rows = PyMem_Malloc(count > 0 ? (size_t)count * sizeof(span_t) : 1);
    if (rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const char *table = (const char *)spans.buf;
    int64_t total = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        int64_t raw[3];
        memcpy(raw, table + k * row, sizeof raw); /* the table need not be aligned */
        int64_t d, s, n = raw[2];
        if (add_i64(raw[0], (int64_t)dst_shift, &d) < 0 || add_i64(raw[1], (int64_t)src_shift, &s) < 0 ||
            n < 0 || d < 0 || s < 0 || d > (int64_t)dst.len - n || s > (int64_t)src.len - n) {
            PyErr_Format(PyExc_ValueError,
                         "span %zd (dst %lld + %lld, src %lld + %lld, %lld bytes) falls outside the "
                         "buffers (dst %zd bytes, src %zd bytes); nothing was copied",
                         k, (long long)raw[0], dst_shift, (long long)raw[1], src_shift, (long long)n,
                         dst.len, src.len);
            goto done;
        }
        rows[k].dst = d;
        rows[k].src = s;
        rows[k].n = n;
        total += n; /* no overflow: each n fits in a buffer */
    }
    char *dbase = (char *)dst.buf;
    const char *sbase = (const char *)src.buf;
    /* buffers that share memory are copied with memmove, span by span, in order */
    uintptr_t d0 = (uintptr_t)dbase, s0 = (uintptr_t)sbase;
    int overlap = d0 < s0 + (uintptr_t)src.len && s0 < d0 + (uintptr_t)dst.len;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < count; k++) {
        size_t n = (size_t)rows[k].n;
        if (n == 0) continue;
        char *to = dbase + rows[k].dst;
        const char *from = sbase + rows[k].src;
        if (overlap)
            memmove(to, from, n);
        else if (streaming && n >= STREAM_MIN_SPAN)
            copy_stream(to, from, n);
        else
            memcpy(to, from, n);
    }
#ifdef HICACHE_X86
    if (streaming) _mm_sfence(); /* streaming stores are weakly ordered: publish them */
#endif
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(total);
done:
    PyMem_Free(rows);
    if (have_dst) PyBuffer_Release(&dst);
    if (have_src) PyBuffer_Release(&src);
    if (have_spans) PyBuffer_Release(&spans);
    return result;
}

/* Choose the streaming copy: "avx2" (where the CPU has it), "sse2" (x86-64) or "none"
 * (memcpy). Picked once at import; tests switch it to cover every variant on one machine. */
static int select_stream_kind(const char *kind) {
#ifdef HICACHE_X86
    if (strcmp(kind, "avx2") == 0 && __builtin_cpu_supports("avx2")) {
        copy_stream = copy_stream_avx2;
        stream_kind = "avx2";
        return 0;
    }
    if (strcmp(kind, "sse2") == 0) {
        copy_stream = copy_stream_sse2;
        stream_kind = "sse2";
        return 0;
    }
#endif
    if (strcmp(kind, "none") == 0) {
        copy_stream = copy_plain;
        stream_kind = "none";
        return 0;
    }
    return -1;
}

static PyObject *set_stream_kind(PyObject *self, PyObject *arg) {
    (void)self;
    const char *kind = PyUnicode_AsUTF8(arg);
    if (kind == NULL) return NULL;
    const char *previous = stream_kind;
    if (select_stream_kind(kind) < 0) {
        PyErr_Format(PyExc_ValueError, "streaming copy %R is not available on this CPU", arg);
        return NULL;
    }
    return PyUnicode_FromString(previous);
}

static PyMethodDef methods[] = {
    {"copy_spans", (PyCFunction)(void (*)(void))copy_spans, METH_VARARGS | METH_KEYWORDS, copy_spans_doc},
    {"_set_stream_kind", set_stream_kind, METH_O,
     "_set_stream_kind(kind) -> previous kind: 'avx2', 'sse2' or 'none' (for tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_spancopy",
    .m_doc = "Bulk span copies with streaming stores, for hicache's CPU copy engine.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__spancopy(void) {
#ifdef HICACHE_X86
    __builtin_cpu_init();
    if (select_stream_kind("avx2") < 0) select_stream_kind("sse2");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "STREAM_KIND", stream_kind) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
