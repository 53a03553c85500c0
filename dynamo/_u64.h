/*
 * dynamo/_u64.h: a Python int in [0, 2**64) as a C uint64_t, for the native modules that read
 * block hashes (half of them are >= 2**63).
 *
 * Why: in CPython 3.11 ``PyLong_AsUnsignedLongLong`` converts through ``_PyLong_AsByteArray``
 * (a byte-by-byte copy, ~4x the cost of a digit loop), while ``PyLong_AsUnsignedLong`` reads the
 * digits directly. Where ``unsigned long`` is 64 bits (LP64: Linux, macOS) both accept exactly
 * the same values, raise the same exception types (TypeError for a non-int, OverflowError for a
 * negative or too large one) and return all ones on error, so the faster one is used there.
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

#endif
