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

/* Spans shorter than this are copied with memcpy even when streaming: the aligned head/tail and
 * the store fence cost more than the cache traffic saved. */
#define STREAM_MIN_SPAN 4096

typedef void (*copy_fn)(char *dst, const char *src, size_t n);

static void copy_plain(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }

#ifdef HICACHE_X86
/* Streaming copy with 16-byte SSE2 stores (every x86-64 CPU has them). */
static void copy_stream_sse2(char *dst, const char *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
}

/* The same with 32-byte AVX2 stores, compiled for AVX2 only here and chosen at import time. */
__attribute__((target("avx2"))) static void copy_stream_avx2(char *dst, const char *src, size_t n) {
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    size_t body = n & ~(size_t)127;
    for (size_t i = 0; i < body; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    memcpy(dst + body, src + body, n - body);
}
#endif

static copy_fn copy_stream = copy_plain;
static const char *stream_kind = "none";

static int64_t read_i64(const char *p) {
    int64_t v;
    memcpy(&v, p, sizeof v); /* the span table need not be aligned */
    return v;
}

PyDoc_STRVAR(copy_spans_doc,
"copy_spans(dst, src, spans, dst_shift=0, src_shift=0, streaming=False) -> int\n\n"
"For each row (d, s, n) of ``spans`` (native int64, n rows of 3), copy ``n`` bytes from\n"
"``src[s + src_shift:]`` to ``dst[d + dst_shift:]``. ``dst`` is a writable buffer, ``src`` any\n"
"buffer. Every span is bounds-checked first; a bad one raises ValueError and nothing is copied.\n"
"``streaming`` uses non-temporal stores for spans of 4 KiB and more (big copies whose\n"
"destination is not read again soon). The GIL is released while copying. Returns the bytes\n"
"copied.");

static PyObject *copy_spans(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"dst", "src", "spans", "dst_shift", "src_shift", "streaming", NULL};
    Py_buffer dst, src, spans;
    long long dst_shift = 0, src_shift = 0;
    int streaming = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "w*y*y*|LLp:copy_spans", keywords, &dst, &src,
                                     &spans, &dst_shift, &src_shift, &streaming))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t row = 3 * (Py_ssize_t)sizeof(int64_t);
    if (spans.len % row != 0) {
        PyErr_Format(PyExc_ValueError, "spans holds %zd bytes, not a whole number of (dst, src, nbytes) int64 rows",
                     spans.len);
        goto done;
    }
    const Py_ssize_t count = spans.len / row;
    const char *table = (const char *)spans.buf;
    int64_t total = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        int64_t d = read_i64(table + k * row) + dst_shift;
        int64_t s = read_i64(table + k * row + 8) + src_shift;
        int64_t n = read_i64(table + k * row + 16);
        if (n < 0 || d < 0 || s < 0 || d > (int64_t)dst.len - n || s > (int64_t)src.len - n) {
            PyErr_Format(PyExc_ValueError,
                         "span %zd (dst %lld, src %lld, %lld bytes) falls outside the buffers "
                         "(dst %zd bytes, src %zd bytes); nothing was copied",
                         k, (long long)d, (long long)s, (long long)n, dst.len, src.len);
            goto done;
        }
        total += n;
    }
    char *dbase = (char *)dst.buf;
    const char *sbase = (const char *)src.buf;
    /* buffers that share memory are copied with memmove, span by span */
    int overlap = dbase < sbase + src.len && sbase < dbase + dst.len;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < count; k++) {
        int64_t d = read_i64(table + k * row) + dst_shift;
        int64_t s = read_i64(table + k * row + 8) + src_shift;
        size_t n = (size_t)read_i64(table + k * row + 16);
        if (overlap)
            memmove(dbase + d, sbase + s, n);
        else if (streaming && n >= STREAM_MIN_SPAN)
            copy_stream(dbase + d, sbase + s, n);
        else
            memcpy(dbase + d, sbase + s, n);
    }
#ifdef HICACHE_X86
    if (streaming) _mm_sfence(); /* streaming stores are weakly ordered: publish them */
#endif
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(total);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&spans);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_spans", (PyCFunction)(void (*)(void))copy_spans, METH_VARARGS | METH_KEYWORDS, copy_spans_doc},
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
    if (__builtin_cpu_supports("avx2")) {
        copy_stream = copy_stream_avx2;
        stream_kind = "avx2";
    } else {
        copy_stream = copy_stream_sse2;
        stream_kind = "sse2";
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "STREAM_KIND", stream_kind) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
