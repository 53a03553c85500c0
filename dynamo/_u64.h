/*
 * dynamo/_u64.h: a Python int in [0, 2**64) as a C uint64_t, for the native modules that read
 * block hashes (half of them are >= 2**63).
 *
 * Why: in CPython 3.11 ``PyLong_AsUnsignedLongLong`` converts through ``_PyLong_AsByteArray``
 * (a byte-by-byte copy, ~4x the cost of a digit loop), while ``PyLong_AsUnsignedLong`` reads the
 * digits directly. Where ``unsigned long`` is 64 bits (LP64: Linux, macOS) both accept exactly
 * the same values, raise the same exception types (TypeError for a non-int, OverflowError for a
 * negative or too large one) and return all ones on error, so the faster one is used there.
 * ``dyn_u64_digits`` reads an exact non-negative int's digits directly (the common case).
 */
#ifndef DYNAMO_U64_H
#define DYNAMO_U64_H

#include <Python.h>
#include <limits.h>
#include <stdint.h>

#if ULONG_MAX == UINT64_MAX
#define DYN_AS_U64(obj) ((unsigned long long)PyLong_AsUnsignedLong(obj))
#else
#define DYN_AS_U64(obj) PyLong_AsUnsignedLongLong(obj)
#endif

/* An exact int in [0, 2**64) of CPython 3.11's layout (at most three 30-bit digits) read from
 * its digits: 1 with *out set. 0 for anything else (a negative or wider int, a subclass, another
 * version): the caller converts it through the API, which gives the same value for such an
 * int. Block hashes are uniform 64-bit values, so half of them are >= 2**63, where the API's
 * signed conversion overflows and a second, unsigned one follows (~3x the digit read). */
static inline int
dyn_u64_digits(PyObject *obj, uint64_t *out)
{
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    if (PyLong_CheckExact(obj)) {
        Py_ssize_t size = Py_SIZE(obj);
        if (size >= 0 && size <= 3) {
            const digit *d = ((PyLongObject *)obj)->ob_digit;
            if (size < 3 || d[2] < (1U << (64 - 2 * PyLong_SHIFT))) {
                uint64_t x = 0;
                for (Py_ssize_t i = size - 1; i >= 0; i--)
                    x = (x << PyLong_SHIFT) | d[i];
                *out = x;
                return 1;
            }
        }
    }
#else
    (void)obj;
    (void)out;
#endif
    return 0;
}

#endif
