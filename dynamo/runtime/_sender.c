/*
 * dynamo.runtime._sender: Sender, a write-behind thread for small HTTP servers.
 *
 * Why: on loopback a write() runs the receiver's whole TCP input path and wakes it, in the
 * writer's context; for the slot tracker that was about a third of each request's CPU, all of
 * it under the GIL because uvloop writes while holding it. A second event loop thread does not
 * help (the GIL serialises it, and each hand-off costs a futex wake-up). This thread never
 * touches a Python object and never takes the GIL, so those writes run on another core while
 * the event loop parses and answers the next requests.
 *
 * Contract: the owner hands over a file descriptor of its own (a dup of the connection's
 * socket) and from then on sends every byte for that connection through the Sender, which
 * keeps each descriptor's bytes in order and performs its shutdown/close markers after the
 * bytes queued before them. send/shutdown_write/close only queue (a copy of the data); flush
 * wakes the thread when it sleeps (call it once per event loop iteration). A descriptor whose
 * peer does not read is kept in a backlog and polled for POLLOUT; once more than
 * max_backlog_bytes of its bytes are held unwritten (a single large send counts too) it is shut
 * down (both directions), so the connection's owner sees it end. Write errors (the peer
 * is gone) drop that descriptor's data until its close marker.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { OP_DATA, OP_SHUTDOWN_WRITE, OP_CLOSE };

typedef struct Node {
    struct Node *next;
    int fd;
    int op;
    size_t len;
    size_t off; /* bytes of data already written */
    char data[];
} Node;

/* A descriptor with bytes the kernel would not take yet, or whose peer is gone. */
typedef struct Backlog {
    struct Backlog *next;
    int fd;
    int dead; /* write failed or over the cap: drop data until the close marker */
    size_t bytes;
    Node *head, *tail;
} Backlog;

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    int thread_started;
    pthread_mutex_t mutex;
    /* Guarded by mutex. */
    Node *head, *tail;
    int sleeping;
    int stopping;
    double stop_deadline; /* CLOCK_MONOTONIC seconds */
    /* Owned by the thread. */
    Backlog *backlogs;
    /* Read-only after start. */
    int wake_fd; /* -1 once the thread is joined */
    int mutex_ready;
    size_t max_backlog_bytes;
    /* Updated by the thread, read under mutex. */
    unsigned long long dropped_connections;
} Sender;

static double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void
free_nodes(Node *node)
{
    while (node != NULL) {
        Node *next = node->next;
        free(node);
        node = next;
    }
}

/* Write node's remaining data: 0 done, 1 the kernel would block, -1 failed (peer gone). */
static int
write_node(Node *node)
{
    while (node->off < node->len) {
        /* MSG_NOSIGNAL: a gone peer is an EPIPE here, never a SIGPIPE for the process. */
        ssize_t n = send(node->fd, node->data + node->off, node->len - node->off, MSG_NOSIGNAL);
        if (n > 0) {
            node->off += (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return 1;
        } else {
            return -1;
        }
    }
    return 0;
}

static Backlog *
find_backlog(Sender *s, int fd)
{
    for (Backlog *b = s->backlogs; b != NULL; b = b->next) {
        if (b->fd == fd) {
            return b;
        }
    }
    return NULL;
}

static void
remove_backlog(Sender *s, Backlog *gone)
{
    for (Backlog **p = &s->backlogs; *p != NULL; p = &(*p)->next) {
        if (*p == gone) {
            *p = gone->next;
            free_nodes(gone->head);
            free(gone);
            return;
        }
    }
}

static void
kill_backlog(Sender *s, Backlog *b)
{
    /* Keep the close marker (if queued) and drop every byte: the connection is over. */
    Node *keep = NULL, *last = NULL;
    Node *node = b->head;
    while (node != NULL) {
        Node *next = node->next;
        if (node->op == OP_CLOSE) {
            node->next = NULL;
            if (last != NULL) {
                last->next = node;
            } else {
                keep = node;
            }
            last = node;
        } else {
            free(node);
        }
        node = next;
    }
    b->head = keep;
    b->tail = last;
    b->bytes = 0;
    if (!b->dead) {
        b->dead = 1;
        shutdown(b->fd, SHUT_RDWR);
        pthread_mutex_lock(&s->mutex);
        s->dropped_connections++;
        pthread_mutex_unlock(&s->mutex);
    }
}

static void
append_to_backlog(Backlog *b, Node *node)
{
    node->next = NULL;
    if (b->tail != NULL) {
        b->tail->next = node;
    } else {
        b->head = node;
    }
    b->tail = node;
    if (node->op == OP_DATA) {
        b->bytes += node->len - node->off;
    }
}

/* Perform a node on a descriptor with no backlog; returns the backlog it starts, if any. */
static void
perform(Sender *s, Node *node)
{
    int rc;
    Backlog *b;
    switch (node->op) {
    case OP_DATA:
        rc = write_node(node);
        if (rc == 0) {
            free(node);
            return;
        }
        b = calloc(1, sizeof(Backlog));
        if (b == NULL) { /* out of memory: give the connection up */
            shutdown(node->fd, SHUT_RDWR);
            free(node);
            return;
        }
        b->fd = node->fd;
        b->next = s->backlogs;
        s->backlogs = b;
        append_to_backlog(b, node);
        if (rc < 0 || b->bytes > s->max_backlog_bytes) {
            kill_backlog(s, b);
        }
        return;
    case OP_SHUTDOWN_WRITE:
        shutdown(node->fd, SHUT_WR);
        free(node);
        return;
    default: /* OP_CLOSE */
        close(node->fd);
        free(node);
        return;
    }
}

/* Write what a backlogged descriptor's kernel buffer takes now; drop the backlog when done. */
static void
drain_backlog(Sender *s, Backlog *b)
{
    while (b->head != NULL) {
        Node *node = b->head;
        if (node->op == OP_DATA) {
            if (b->dead) {
                b->head = node->next;
                if (b->head == NULL) {
                    b->tail = NULL;
                }
                free(node);
                continue;
            }
            size_t before = node->off;
            int rc = write_node(node);
            b->bytes -= node->off - before;
            if (rc > 0) {
                return;
            }
            if (rc < 0) {
                kill_backlog(s, b);
                continue;
            }
        } else if (node->op == OP_SHUTDOWN_WRITE) {
            if (!b->dead) {
                shutdown(node->fd, SHUT_WR);
            }
        } else {
            close(node->fd);
            b->head = node->next;
            free(node);
            b->head = b->tail = NULL; /* nothing can follow a close */
            remove_backlog(s, b);
            return;
        }
        b->head = node->next;
        if (b->head == NULL) {
            b->tail = NULL;
        }
        free(node);
    }
    if (!b->dead) {
        remove_backlog(s, b); /* caught up: later nodes are written directly */
    }
}

static void
handle_batch(Sender *s, Node *node)
{
    while (node != NULL) {
        Node *next = node->next;
        node->next = NULL;
        Backlog *b = find_backlog(s, node->fd);
        if (b == NULL) {
            perform(s, node);
        } else {
            append_to_backlog(b, node);
            if (b->bytes > s->max_backlog_bytes) {
                kill_backlog(s, b);
            }
            if (b->dead) {
                drain_backlog(s, b); /* drops data; performs a close marker */
            }
        }
        node = next;
    }
}

static void
wait_for_work(Sender *s, int timeout_ms)
{
    nfds_t n = 1;
    for (Backlog *b = s->backlogs; b != NULL; b = b->next) {
        n += !b->dead;
    }
    struct pollfd *fds = calloc(n, sizeof(struct pollfd));
    if (fds == NULL) {
        usleep(1000);
        return;
    }
    fds[0].fd = s->wake_fd;
    fds[0].events = POLLIN;
    nfds_t k = 1;
    for (Backlog *b = s->backlogs; b != NULL; b = b->next) {
        if (!b->dead) {
            fds[k].fd = b->fd;
            fds[k].events = POLLOUT;
            k++;
        }
    }
    poll(fds, n, timeout_ms);
    if (fds[0].revents & POLLIN) {
        uint64_t counter;
        ssize_t ignored = read(s->wake_fd, &counter, sizeof(counter));
        (void)ignored;
    }
    for (nfds_t i = 1; i < n; i++) {
        if (fds[i].revents != 0) {
            Backlog *b = find_backlog(s, fds[i].fd);
            if (b != NULL) {
                if (fds[i].revents & (POLLERR | POLLHUP | POLLNVAL)) {
                    kill_backlog(s, b);
                }
                drain_backlog(s, b);
            }
        }
    }
    free(fds);
}

/* How long the thread looks for more work before it sleeps. Under load the next batch comes
 * within this window, so the event loop rarely pays for a wake-up (an eventfd write and an
 * IPI: a tenth of its time per request when the thread slept after every batch). */
#define SPIN_S 50e-6

static int
spin_for_work(Sender *s)
{
    double until = now_s() + SPIN_S;
    do {
        if (__atomic_load_n(&s->head, __ATOMIC_ACQUIRE) != NULL) {
            return 1;
        }
        sched_yield(); /* lets whatever else wants this core run */
    } while (now_s() < until);
    return 0;
}

static void *
run(void *arg)
{
    Sender *s = arg;
    int spun = 0;
    for (;;) {
        pthread_mutex_lock(&s->mutex);
        Node *batch = s->head;
        __atomic_store_n(&s->head, NULL, __ATOMIC_RELAXED);
        s->tail = NULL;
        int stopping = s->stopping;
        double deadline = s->stop_deadline;
        int spin = batch == NULL && !stopping && s->backlogs == NULL && !spun;
        if (batch == NULL && !spin) {
            if (stopping && (s->backlogs == NULL || now_s() >= deadline)) {
                pthread_mutex_unlock(&s->mutex);
                break;
            }
            s->sleeping = 1;
        }
        pthread_mutex_unlock(&s->mutex);
        if (batch != NULL) {
            handle_batch(s, batch);
            spun = 0;
            continue;
        }
        if (spin) {
            spun = !spin_for_work(s); /* found nothing: sleep on the next round */
            continue;
        }
        spun = 0;
        int timeout_ms = -1;
        if (stopping) {
            double left = deadline - now_s();
            timeout_ms = left > 0 ? (int)(left * 1000) + 1 : 0;
        }
        wait_for_work(s, timeout_ms);
        pthread_mutex_lock(&s->mutex);
        s->sleeping = 0;
        pthread_mutex_unlock(&s->mutex);
    }
    /* Stopped: descriptors still backlogged lose their bytes. */
    while (s->backlogs != NULL) {
        Backlog *b = s->backlogs;
        close(b->fd);
        s->backlogs = b->next;
        free_nodes(b->head);
        free(b);
    }
    return NULL;
}

/* ------------------------------------------------------------------ the Python type */

static int
enqueue(Sender *s, Node *node)
{
    node->next = NULL;
    pthread_mutex_lock(&s->mutex);
    if (s->stopping) {
        pthread_mutex_unlock(&s->mutex);
        free(node);
        PyErr_SetString(PyExc_RuntimeError, "Sender is stopped");
        return -1;
    }
    if (s->tail != NULL) {
        s->tail->next = node;
    } else {
        __atomic_store_n(&s->head, node, __ATOMIC_RELEASE); /* seen by spin_for_work */
    }
    s->tail = node;
    pthread_mutex_unlock(&s->mutex);
    return 0;
}

static int
as_fd(PyObject *obj)
{
    long fd = PyLong_AsLong(obj);
    if (fd == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (fd < 0 || fd > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "not a file descriptor: %ld", fd);
        return -1;
    }
    return (int)fd;
}

static Node *
new_node(int fd, int op, const void *data, size_t len)
{
    Node *node = malloc(sizeof(Node) + len);
    if (node == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    node->fd = fd;
    node->op = op;
    node->len = len;
    node->off = 0;
    if (len != 0) {
        memcpy(node->data, data, len);
    }
    return node;
}

static void
wake(Sender *s)
{
    uint64_t one = 1;
    if (s->wake_fd < 0) {
        return;
    }
    ssize_t ignored = write(s->wake_fd, &one, sizeof(one));
    (void)ignored;
}

static PyObject *
Sender_send(Sender *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "send(fd, data) takes 2 arguments");
        return NULL;
    }
    int fd = as_fd(args[0]);
    if (fd < 0) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Node *node = new_node(fd, OP_DATA, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    if (node == NULL || enqueue(self, node) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
queue_marker(Sender *self, PyObject *arg, int op)
{
    int fd = as_fd(arg);
    if (fd < 0) {
        return NULL;
    }
    Node *node = new_node(fd, op, NULL, 0);
    if (node == NULL || enqueue(self, node) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
Sender_shutdown_write(Sender *self, PyObject *arg)
{
    return queue_marker(self, arg, OP_SHUTDOWN_WRITE);
}

static PyObject *
Sender_close(Sender *self, PyObject *arg)
{
    return queue_marker(self, arg, OP_CLOSE);
}

static PyObject *
Sender_flush(Sender *self, PyObject *Py_UNUSED(ignored))
{
    pthread_mutex_lock(&self->mutex);
    int asleep_with_work = self->sleeping && self->head != NULL;
    if (asleep_with_work) {
        self->sleeping = 0; /* one wake-up is enough until it sleeps again */
    }
    pthread_mutex_unlock(&self->mutex);
    if (asleep_with_work) {
        wake(self);
    }
    Py_RETURN_NONE;
}

static void
stop_thread(Sender *self, double timeout_s)
{
    if (!self->thread_started) {
        return;
    }
    pthread_mutex_lock(&self->mutex);
    if (!self->stopping) {
        self->stopping = 1;
        self->stop_deadline = now_s() + timeout_s;
    }
    pthread_mutex_unlock(&self->mutex);
    wake(self);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
    self->thread_started = 0;
    close(self->wake_fd); /* nothing waits on it any more */
    self->wake_fd = -1;
}

static PyObject *
Sender_stop(Sender *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout", NULL};
    double timeout_s = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|d:stop", kwlist, &timeout_s)) {
        return NULL;
    }
    if (!(timeout_s >= 0.0)) { /* negative or NaN */
        timeout_s = 0.0;
    }
    if (timeout_s > 86400.0) { /* keeps the poll timeout in range; a day is "forever" here */
        timeout_s = 86400.0;
    }
    stop_thread(self, timeout_s);
    Py_RETURN_NONE;
}

static PyObject *
Sender_dropped_connections(Sender *self, void *Py_UNUSED(closure))
{
    pthread_mutex_lock(&self->mutex);
    unsigned long long dropped = self->dropped_connections;
    pthread_mutex_unlock(&self->mutex);
    return PyLong_FromUnsignedLongLong(dropped);
}

static PyObject *
Sender_running(Sender *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->thread_started);
}

static PyObject *
Sender_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max_backlog_bytes", NULL};
    Py_ssize_t max_backlog = 16 * 1024 * 1024;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:Sender", kwlist, &max_backlog)) {
        return NULL;
    }
    if (max_backlog <= 0) {
        PyErr_SetString(PyExc_ValueError, "max_backlog_bytes must be positive");
        return NULL;
    }
    Sender *self = (Sender *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->wake_fd = -1;
    self->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->wake_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    self->max_backlog_bytes = (size_t)max_backlog;
    pthread_mutex_init(&self->mutex, NULL);
    self->mutex_ready = 1;
    int rc = pthread_create(&self->thread, NULL, run, self);
    if (rc != 0) {
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    self->thread_started = 1;
    return (PyObject *)self;
}

static void
Sender_dealloc(Sender *self)
{
    stop_thread(self, 0.0);
    free_nodes(self->head);
    if (self->wake_fd >= 0) {
        close(self->wake_fd);
    }
    if (self->mutex_ready) {
        pthread_mutex_destroy(&self->mutex);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Sender_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Sender_send, METH_FASTCALL,
     "send(fd, data): queue a copy of data for fd (bytes-like)."},
    {"shutdown_write", (PyCFunction)Sender_shutdown_write, METH_O,
     "shutdown_write(fd): queue shutdown(fd, SHUT_WR) after the bytes queued before it."},
    {"close", (PyCFunction)Sender_close, METH_O,
     "close(fd): queue close(fd) after everything queued before it; fd is the Sender's now."},
    {"flush", (PyCFunction)Sender_flush, METH_NOARGS,
     "flush(): wake the thread if it sleeps with work queued."},
    {"stop", (PyCFunction)(void (*)(void))Sender_stop, METH_VARARGS | METH_KEYWORDS,
     "stop(timeout=1.0): finish the queue, give backlogged descriptors up to timeout "
     "seconds, close what is left and join the thread. Later calls queue nothing."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Sender_getset[] = {
    {"dropped_connections", (getter)Sender_dropped_connections, NULL,
     "Connections shut down because their peer stopped reading or was gone.", NULL},
    {"running", (getter)Sender_running, NULL, "Whether the thread runs.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dynamo.runtime._sender.Sender",
    .tp_doc = PyDoc_STR("Sender(max_backlog_bytes=16 MiB): a write-behind thread (see the "
                        "module's source for the contract)."),
    .tp_basicsize = sizeof(Sender),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Sender_new,
    .tp_dealloc = (destructor)Sender_dealloc,
    .tp_methods = Sender_methods,
    .tp_getset = Sender_getset,
};

static struct PyModuleDef sender_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dynamo.runtime._sender",
    .m_doc = "A write-behind thread that writes to sockets without the GIL.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__sender(void)
{
    if (PyType_Ready(&SenderType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&sender_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&SenderType);
    if (PyModule_AddObject(module, "Sender", (PyObject *)&SenderType) < 0) {
        Py_DECREF(&SenderType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
