/*
 * dynamo/engine_core/_kv_api.h: the native KV manager's calls for C callers, as a capsule
 * ``dynamo.engine_core._kv._C_API_4`` (a DynKVApi; the number changes with the struct: ``_2``
 * gave the admission's calls a slots array, ``_3`` added the flags, ``allocate_unique`` and
 * ``drain``, ``_4`` the slots of promoted and released blocks, so a stale build of either
 * module finds no capsule and the pass calls the methods), so that ``_pass.c`` converts an admitted
 * prompt's chain of block hashes once
 * instead of once per method call (``num_cached_prefix``, ``num_slots_needed``, ``use``: each
 * converted the same 64-bit ints), and promotes filled
 * blocks and releases a sequence's blocks from its lists' items (``promote_run``, ``release``:
 * no slices, no method call).
 *
 * Each function takes an instance of ``type`` (the native ``KVManager``) and does exactly what
 * its method does with the chain whose keys ``keys_of`` gave (``ok[i]`` 0: ``items[i]`` is not
 * a 64-bit int, for which the methods' lookups find nothing and ``use`` raises). A caller with
 * any other KV manager (the Python twin) calls the methods.
 */
#ifndef DYNAMO_KV_API_H
#define DYNAMO_KV_API_H

#include <Python.h>
#include <stdint.h>

#define DYN_KV_API_CAPSULE "dynamo.engine_core._kv._C_API_4"

/* ``slots``: the caller's array of one int32 a chain's key, each DYN_KV_SLOT_UNKNOWN before
 * the admission's first call: the calls below look each key up once and keep its table slot
 * there for the next (an admission's three calls looked each block up four times). Valid while
 * the manager does not change between the calls (the admission makes no other call on it).
 * After ``use`` each of its n blocks' slot is there (the block it found or stored).
 *
 * A block's slot stays its own while the block is held (a referenced full block is never
 * evicted or moved), so the pass keeps the slots of a sequence's full blocks
 * (``Sequence.full_slots``: ``use``'s, then ``promote_run``'s ``slots_out``) and its release
 * hands them back: ``release`` checks each against its hash (the entry is a full block of
 * that key) and looks up only a hash whose slot does not match. */
#define DYN_KV_SLOT_UNKNOWN (-2)

typedef struct {
    PyTypeObject *type;
    /* items[:n] as keys; never fails (what is not a 64-bit int gets ok 0) */
    void (*keys_of)(PyObject *const *items, Py_ssize_t n, uint64_t *keys, uint8_t *negs,
                    uint8_t *ok);
    /* num_cached_prefix(items[:n]) */
    Py_ssize_t (*cached_prefix)(PyObject *kv, const uint64_t *keys, const uint8_t *ok,
                                int32_t *slots, Py_ssize_t n);
    /* num_slots_needed(items[:n], 0) */
    Py_ssize_t (*slots_missing)(PyObject *kv, const uint64_t *keys, const uint8_t *ok,
                                int32_t *slots, Py_ssize_t n);
    /* use(items[:n], litems[:n], announce=announce): 0, or -1 with its error */
    int (*use)(PyObject *kv, PyObject *const *items, PyObject *const *litems, uint64_t *keys,
               uint8_t *negs, const uint8_t *ok, int32_t *slots, Py_ssize_t n, int announce);
    /* promote_run(uids[:n], hashes[:n], locals[:n], parent): 0, or -1 with its error;
     * ``slots_out`` (NULL: none) gets each promoted block's slot */
    int (*promote_run)(PyObject *kv, PyObject *const *uids, PyObject *const *hashes,
                       PyObject *const *locals, Py_ssize_t n, PyObject *parent,
                       int32_t *slots_out);
    /* release(hashes[:nh], uids[:nu]): 0, or -1 with its error; ``slots`` (NULL: none) the
     * hashes' slots as kept (each checked against its hash) */
    int (*release)(PyObject *kv, PyObject *const *hashes, const int32_t *slots, Py_ssize_t nh,
                   PyObject *const *uids, Py_ssize_t nu);
    /* enable_prefix_caching, raw_events (0 or 1) and num_available_blocks: never fail */
    int (*caching)(PyObject *kv);
    int (*raw)(PyObject *kv);
    Py_ssize_t (*available)(PyObject *kv);
    /* allocate_unique(n) for n >= 0: a new list of ids, a new reference to None when there is
     * no room, or NULL with its error */
    PyObject *(*allocate_unique)(PyObject *kv, Py_ssize_t n);
    /* drain_raw_events() if raw else drain_events(): the method's result, or NULL with its
     * error */
    PyObject *(*drain)(PyObject *kv, int raw);
} DynKVApi;

#endif
