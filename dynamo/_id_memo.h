/*
 * dynamo/_id_memo.h: the keys last converted from a sequence of hash objects, by identity, for
 * the native modules that convert a prompt's block hashes on every call (``engine_core/_kv.c``'s
 * admission, ``router/_blocks.c``'s prefix keys, ``router/_radix.c``'s match walk).
 *
 * Why: the offline replay's prompts of one prefix group share their leading hash objects
 * (``router.hashing.SharedPrefixHasher``), ~64 of a request's ~72, so a call whose leading items
 * are the same objects as the last call's that began with the same object reads their keys
 * instead of converting (and chaining) each again. Identity only: an int never changes, so the
 * same object has the same key; the memo holds strong references, so no other object can take
 * one of its addresses while it is there. Anything else is converted, as without it.
 *
 * A memo is a set of ways (an array of ``IdMemo``, 2**bits of them) picked by the first item's
 * address. Each way holds a leading run of one call's items with a key and a flag byte each
 * (the flag is the caller's: e.g. a key's sign). Nothing here raises: out of memory, a way keeps
 * the shorter run it had.
 */
#ifndef DYNAMO_ID_MEMO_H
#define DYNAMO_ID_MEMO_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    Py_ssize_t n, cap;
    PyObject **items; /* strong; one allocation with keys and flags */
    uint64_t *keys;
    uint8_t *flags;
} IdMemo;

/* The way of ``ways`` (2**bits of them) for a call whose first item is ``first``. */
static inline IdMemo *
id_memo_way(IdMemo *ways, int bits, PyObject *first)
{
    return &ways[((uintptr_t)first >> 4) * 0x9E3779B97F4A7C15ULL >> (64 - bits)];
}

/* How many leading items of items[:n] are the way's objects (their keys: m->keys[:same]). */
static inline Py_ssize_t
id_memo_same(const IdMemo *m, PyObject *const *items, Py_ssize_t n)
{
    Py_ssize_t same = 0, most = n < m->n ? n : m->n;
    while (same < most && m->items[same] == items[same])
        same++;
    return same;
}

/* Keep the way's first ``keep`` items (fewer if it holds fewer). */
static inline void
id_memo_truncate(IdMemo *m, Py_ssize_t keep)
{
    for (Py_ssize_t k = keep; k < m->n; k++)
        Py_DECREF(m->items[k]);
    if (keep < m->n)
        m->n = keep;
}

/* Room for n entries, the held ones kept: 0, or -1 (no error set: the way is only not
 * extended). */
static inline int
id_memo_reserve(IdMemo *m, Py_ssize_t n)
{
    if (n <= m->cap)
        return 0;
    size_t entry = sizeof(PyObject *) + sizeof(uint64_t) + 1;
    PyObject **a = PyMem_Malloc((size_t)n * entry);
    if (a == NULL)
        return -1;
    uint64_t *k = (uint64_t *)(a + n);
    uint8_t *g = (uint8_t *)(k + n);
    if (m->n > 0) {
        memcpy(a, m->items, (size_t)m->n * sizeof(PyObject *));
        memcpy(k, m->keys, (size_t)m->n * sizeof(uint64_t));
        memcpy(g, m->flags, (size_t)m->n);
    }
    PyMem_Free(m->items);
    m->items = a, m->keys = k, m->flags = g, m->cap = n;
    return 0;
}

/* items[same:n] become the way's, after its first ``same`` (which it holds), their keys and
 * flags already written to m->keys / m->flags (room reserved for n). */
static inline void
id_memo_adopt(IdMemo *m, PyObject *const *items, Py_ssize_t same, Py_ssize_t n)
{
    id_memo_truncate(m, same);
    for (Py_ssize_t k = same; k < n; k++)
        m->items[k] = Py_NewRef(items[k]);
    if (n > same)
        m->n = n;
}

/* items[:n] become the way's, its first ``same`` held already, with keys[same:n] and
 * flags[same:n] (flags NULL: zeros). Out of memory: the way keeps its first ``same``. */
static inline void
id_memo_keep(IdMemo *m, PyObject *const *items, const uint64_t *keys, const uint8_t *flags,
             Py_ssize_t same, Py_ssize_t n)
{
    if (id_memo_reserve(m, n) < 0) {
        id_memo_truncate(m, same);
        return;
    }
    memcpy(m->keys + same, keys + same, (size_t)(n - same) * sizeof(uint64_t));
    if (flags != NULL)
        memcpy(m->flags + same, flags + same, (size_t)(n - same));
    else
        memset(m->flags + same, 0, (size_t)(n - same));
    id_memo_adopt(m, items, same, n);
}

/* Every way of ``ways`` (``count`` of them) emptied and freed. */
static inline void
id_memo_clear(IdMemo *ways, int count)
{
    for (int w = 0; w < count; w++) {
        id_memo_truncate(&ways[w], 0);
        PyMem_Free(ways[w].items);
        ways[w] = (IdMemo){0, 0, NULL, NULL, NULL};
    }
}

#endif /* DYNAMO_ID_MEMO_H */
