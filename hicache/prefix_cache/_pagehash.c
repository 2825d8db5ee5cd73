/*
 * hicache.prefix_cache._pagehash: the chained sha256 page keys of many pages in one call.
 *
 * Why native code: a page key is sha256(previous digest || the page's uint32 tokens), one per
 * page, on the server's event loop: every page written to storage and every page of a prompt
 * looked up in storage is hashed there. In Python each page costs five calls (slice, concat,
 * sha256, digest, hex) and five objects, about 0.6-0.7 us, of which OpenSSL's hashing of ~300
 * bytes is ~0.15 us; a 16k-token prompt at 64 tokens a page paid ~0.17 ms of loop time before
 * its storage lookup could start. Here the chain runs in C over the packed tokens, with the GIL
 * released for long batches, and each key is written straight into a new str.
 *
 * The digests are OpenSSL's sha256, the library hashlib uses, so the keys are bit-identical to
 * hicache.keys.page_hashes (tests check them against it on random tokens, priors and page
 * sizes). Its SHA256_Init/Update/Final where the headers still declare them (deprecated since
 * OpenSSL 3, not removed; SGLang's own key hasher uses them too), else EVP with the algorithm
 * fetched once. Measured for 288 bytes: 0.165 us, EVP 0.196 us, and the one-shot SHA256() of
 * OpenSSL 3, which fetches the algorithm at every call, 0.378 us. The module is optional: where it cannot be built
 * (no OpenSSL headers), hicache.prefix_cache.hashing hashes in Python.
 *
 * Safety: the token buffer is held (Py_buffer) for the whole call; sizes are checked before
 * anything is hashed; a bad argument raises ValueError or TypeError.
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED /* the low-level sha256 calls, see above */
#include <Python.h>
#include <openssl/evp.h>
#include <openssl/opensslv.h>
#include <openssl/sha.h>

#if defined(OPENSSL_NO_DEPRECATED_3_0) || OPENSSL_VERSION_NUMBER >= 0x40000000L
#define HICACHE_SHA_EVP 1
#endif
#include <stdint.h>
#include <string.h>

/* Batches of at least this many token bytes hash with the GIL released (the server's other
 * threads run meanwhile); below it the release and re-take cost more than they free. */
#define RELEASE_GIL_MIN_BYTES (64 * 1024)

static const char HEX[] = "0123456789abcdef";

/* sha256, fetched once at import (OpenSSL 3) or OpenSSL 1.1's static method */
static const EVP_MD *SHA256_MD = NULL;

/* One digest of ``a`` then ``b``; whether OpenSSL succeeded. */
static int digest2(EVP_MD_CTX *ctx, const unsigned char *a, size_t na, const unsigned char *b, size_t nb,
                   unsigned char *out) {
#ifdef HICACHE_SHA_EVP
    unsigned int len = 0;
    return EVP_DigestInit_ex(ctx, SHA256_MD, NULL) && EVP_DigestUpdate(ctx, a, na) && EVP_DigestUpdate(ctx, b, nb) &&
           EVP_DigestFinal_ex(ctx, out, &len) && len == 32;
#else
    SHA256_CTX sha;
    (void)ctx;
    return SHA256_Init(&sha) && SHA256_Update(&sha, a, na) && SHA256_Update(&sha, b, nb) && SHA256_Final(out, &sha);
#endif
}

/* digests[i] = sha256(prev || data[i * page_bytes : (i + 1) * page_bytes]), where prev is
 * ``prior`` for the first page and the previous digest after it; whether every digest was
 * made. Touches no Python object (it runs with the GIL released). */
static int chain(EVP_MD_CTX *ctx, const unsigned char *data, Py_ssize_t page_bytes, Py_ssize_t n,
                 const unsigned char *prior, Py_ssize_t prior_len, unsigned char *digests) {
    if (!digest2(ctx, prior, (size_t)prior_len, data, (size_t)page_bytes, digests)) return 0;
    for (Py_ssize_t i = 1; i < n; i++) {
        if (!digest2(ctx, digests + 32 * (i - 1), 32, data + i * page_bytes, (size_t)page_bytes, digests + 32 * i))
            return 0;
    }
    return 1;
}

PyDoc_STRVAR(chain_hex_doc,
"chain_hex(data, page_bytes, prior=b'', /) -> list[str]\n\n"
"The hex sha256 keys of the pages of ``data`` (len(data) // page_bytes whole pages), each\n"
"chained to the previous page's digest, the first to ``prior`` (raw bytes; empty: to nothing).");

static PyObject *chain_hex(PyObject *self, PyObject *args) {
    Py_buffer data, prior;
    Py_ssize_t page_bytes;
    prior.buf = NULL;
    if (!PyArg_ParseTuple(args, "y*n|y*:chain_hex", &data, &page_bytes, &prior)) return NULL;
    PyObject *out = NULL;
    unsigned char *digests = NULL;
    EVP_MD_CTX *ctx = NULL;
    const unsigned char *prior_buf = prior.buf ? (const unsigned char *)prior.buf : (const unsigned char *)"";
    Py_ssize_t prior_len = prior.buf ? prior.len : 0;
    if (page_bytes <= 0) {
        PyErr_Format(PyExc_ValueError, "page_bytes must be positive, got %zd", page_bytes);
        goto done;
    }
    if (data.len % page_bytes != 0) {
        PyErr_Format(PyExc_ValueError, "data holds %zd bytes, not a whole number of %zd-byte pages", data.len,
                     page_bytes);
        goto done;
    }
    Py_ssize_t n = data.len / page_bytes;
    out = PyList_New(n);
    if (out == NULL || n == 0) goto done;
    if (n > PY_SSIZE_T_MAX / 32) {
        PyErr_NoMemory();
        Py_CLEAR(out);
        goto done;
    }
    digests = PyMem_RawMalloc((size_t)(32 * n));
    ctx = EVP_MD_CTX_new();
    if (digests == NULL || ctx == NULL) {
        PyErr_NoMemory();
        Py_CLEAR(out);
        goto done;
    }
    int ok;
    if (data.len >= RELEASE_GIL_MIN_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        ok = chain(ctx, data.buf, page_bytes, n, prior_buf, prior_len, digests);
        Py_END_ALLOW_THREADS
    } else {
        ok = chain(ctx, data.buf, page_bytes, n, prior_buf, prior_len, digests);
    }
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL failed to compute a sha256 digest");
        Py_CLEAR(out);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyUnicode_New(64, 127);
        if (key == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        Py_UCS1 *text = PyUnicode_1BYTE_DATA(key);
        const unsigned char *d = digests + 32 * i;
        for (int j = 0; j < 32; j++) {
            text[2 * j] = (Py_UCS1)HEX[d[j] >> 4];
            text[2 * j + 1] = (Py_UCS1)HEX[d[j] & 15];
        }
        PyList_SET_ITEM(out, i, key);
    }
done:
    EVP_MD_CTX_free(ctx);
    PyMem_RawFree(digests);
    PyBuffer_Release(&data);
    if (prior.buf) PyBuffer_Release(&prior);
    return out;
}

static PyMethodDef methods[] = {
    {"chain_hex", chain_hex, METH_VARARGS, chain_hex_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pagehash", "Chained sha256 page keys, many pages per call.", -1, methods,
};

PyMODINIT_FUNC PyInit__pagehash(void) {
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
    SHA256_MD = EVP_MD_fetch(NULL, "SHA256", NULL); /* kept for the life of the process */
#else
    SHA256_MD = EVP_sha256();
#endif
    if (SHA256_MD == NULL) {
        PyErr_SetString(PyExc_ImportError, "OpenSSL has no sha256");
        return NULL;
    }
    return PyModule_Create(&module);
}
