/*
 * formcast's accept worker: a native thread that offers a decode step's tokens
 * to their xgrammar matchers as soon as the tokens land in host memory, without
 * the Python interpreter.
 *
 * Why: on a GPU host a large constrained batch's accept (xgrammar's native
 * work for every row) runs beside the engine's main thread. A Python thread
 * doing it takes the interpreter lock several times a step (after its wait for
 * the tokens, after the native call, to hand its result over), and every hand-off
 * is a futex sleep that leaves the engine's main thread waiting and its core cold.
 * This worker never takes the lock: it polls the step's CUDA event, reads the
 * tokens from the pinned buffer, calls xgrammar's batch accept through tvm-ffi's
 * C ABI, and publishes the verdicts in the job, which Python reads when it needs
 * them.
 *
 * It also drops the last references of objects handed to it (fc_defer_release):
 * destroying a finished batch's xgrammar matchers on the engine's main thread
 * would keep the device idle at the start of the next batch. Their destructors
 * run here, between jobs.
 *
 * A job only takes the usual batch: every token in the vocabulary and none that
 * the matcher wrapper must see itself (blocked, or a stop token that may end the
 * matcher). Otherwise it says so (FC_SLOW) without touching a matcher, and
 * Python offers the tokens the ordinary way.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tvm/ffi/c_api.h>

enum {
  FC_QUEUED = 1,  /* submitted, not finished */
  FC_DONE = 2,    /* verdicts written */
  FC_SLOW = 3,    /* a token the fast path must not offer: no matcher touched */
  FC_DEAD = 4,    /* a row failed to sample (its dead-end flag): no matcher touched */
  FC_ERROR = 5,   /* the device query or the native accept failed: see error */
};

typedef int (*fc_query_fn)(void *);

typedef struct fc_job {
  /* set by the submitter */
  void *fn;               /* tvm-ffi function: xgrammar's native batch accept */
  void *handles;          /* tvm-ffi Array of the matchers (kept alive by the caller) */
  const int64_t *host;    /* [2, stride]: tokens, then dead-end flags */
  int64_t stride;
  const int32_t *cols;    /* the n columns offered, in the matchers' order */
  int32_t n;
  int64_t vocab;          /* tokens offered lie in [0, vocab) */
  const uint8_t *special; /* bitmap of tokens the fast path must not offer, or NULL */
  fc_query_fn query;      /* 0 once the tokens landed, not_ready until then; NULL: landed */
  void *query_arg;
  int32_t not_ready;
  int32_t poll_pauses;    /* pauses between two queries of the event (0: 32) */
  int8_t *verdicts;       /* n: 1 taken, 0 refused */
  char error[480];
  volatile int32_t state;
  struct fc_job *next;
} fc_job;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wake = PTHREAD_COND_INITIALIZER;
static fc_job *g_head = NULL, *g_tail = NULL;
static int g_running = 0, g_stop = 0, g_sleeping = 0;
static pthread_t g_thread;
static TVMFFIObjectHandle g_make_array = NULL;
/* objects whose last reference the worker drops: a growing array, under g_lock */
static TVMFFIObjectHandle *g_graves = NULL;
static size_t g_grave_count = 0, g_grave_cap = 0;
/* released at a time, so that a job waits for a few destructors at most */
#define FC_RELEASE_BATCH 16

static void relax(long *spins, int pauses) {
  /* spin hot for the usual wait (a millisecond or so), then let the core go. A
   * round is ``pauses`` pauses (32: a microsecond or so), so that a wait on the
   * device's event asks the driver (whose lock the engine's launches take too)
   * once a round at most */
  if (++*spins < 1000) {
    for (int i = 0; i < pauses; ++i) __builtin_ia32_pause();
  } else {
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
  }
}

static void fail(fc_job *job, const char *what, TVMFFIObjectHandle err) {
  const char *msg = "";
  size_t len = 0;
  if (err != NULL) {
    const TVMFFIErrorCell *cell =
        (const TVMFFIErrorCell *)((const char *)err + sizeof(TVMFFIObject));
    msg = cell->message.data;
    len = cell->message.size;
  }
  snprintf(job->error, sizeof(job->error), "%s%s%.*s", what, len ? ": " : "", (int)len, msg);
  if (err != NULL) TVMFFIObjectDecRef(err);
  __atomic_store_n(&job->state, FC_ERROR, __ATOMIC_RELEASE);
}

static void run(fc_job *job) {
  if (job->query != NULL) {
    long spins = 0;
    int r;
    while ((r = job->query(job->query_arg)) != 0) {
      if (r != job->not_ready) {
        char what[64];
        snprintf(what, sizeof(what), "the device's event query failed (error %d)", r);
        fail(job, what, NULL);
        return;
      }
      relax(&spins, job->poll_pauses > 0 ? job->poll_pauses : 32);
    }
  }
  const int64_t *tokens = job->host, *dead = job->host + job->stride;
  for (int64_t c = 0; c < job->stride; ++c) {
    if (dead[c]) {
      __atomic_store_n(&job->state, FC_DEAD, __ATOMIC_RELEASE);
      return;
    }
  }
  int32_t n = job->n;
  TVMFFIAny *items = (TVMFFIAny *)calloc(n > 0 ? n : 1, sizeof(TVMFFIAny));
  if (items == NULL) {
    fail(job, "out of memory", NULL);
    return;
  }
  for (int32_t k = 0; k < n; ++k) {
    int64_t t = tokens[job->cols[k]];
    if (t < 0 || t >= job->vocab ||
        (job->special != NULL && (job->special[t >> 3] >> (t & 7)) & 1)) {
      free(items);
      __atomic_store_n(&job->state, FC_SLOW, __ATOMIC_RELEASE);
      return;
    }
    items[k].type_index = kTVMFFIInt;
    items[k].v_int64 = t;
  }
  TVMFFIAny array = {0}, result = {0};
  if (TVMFFIFunctionCall(g_make_array, items, n, &array) != 0) {
    TVMFFIObjectHandle err = NULL;
    TVMFFIErrorMoveFromRaised(&err);
    free(items);
    fail(job, "making the token array failed", err);
    return;
  }
  free(items);
  TVMFFIAny args[3];
  memset(args, 0, sizeof(args));
  args[0].type_index = ((TVMFFIObject *)job->handles)->type_index;
  args[0].v_obj = (TVMFFIObject *)job->handles;
  args[1] = array;
  args[2].type_index = kTVMFFIBool;
  args[2].v_int64 = 0;
  int rc = TVMFFIFunctionCall(job->fn, args, 3, &result);
  if (array.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(array.v_obj);
  if (rc != 0) {
    TVMFFIObjectHandle err = NULL;
    TVMFFIErrorMoveFromRaised(&err);
    fail(job, "xgrammar's batch accept failed", err);
    return;
  }
  if (result.type_index != kTVMFFIArray) {
    if (result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
    fail(job, "xgrammar's batch accept answered something other than an array", NULL);
    return;
  }
  const TVMFFISeqCell *seq =
      (const TVMFFISeqCell *)((const char *)result.v_obj + sizeof(TVMFFIObject));
  if (seq->size != n) {
    TVMFFIObjectDecRef(result.v_obj);
    fail(job, "xgrammar's batch accept answered for another number of rows", NULL);
    return;
  }
  const TVMFFIAny *got = (const TVMFFIAny *)seq->data;
  for (int32_t k = 0; k < n; ++k) job->verdicts[k] = got[k].v_int64 != 0;
  TVMFFIObjectDecRef(result.v_obj);
  __atomic_store_n(&job->state, FC_DONE, __ATOMIC_RELEASE);
}

static void *worker(void *arg) {
  (void)arg;
  for (;;) {
    fc_job *job = NULL;
    TVMFFIObjectHandle graves[FC_RELEASE_BATCH];
    size_t released = 0;
    long spins = 0;
    for (;;) {
      /* look for work without the lock first: the usual wait for a job is short */
      if (__atomic_load_n(&g_head, __ATOMIC_ACQUIRE) != NULL ||
          __atomic_load_n(&g_grave_count, __ATOMIC_ACQUIRE) != 0 || spins > 4000) {
        pthread_mutex_lock(&g_lock);
        while (g_head == NULL && g_grave_count == 0 && !g_stop) {
          g_sleeping = 1;
          pthread_cond_wait(&g_wake, &g_lock);
          g_sleeping = 0;
        }
        if (g_head != NULL) {  /* jobs first: the engine waits for them */
          job = g_head;
          g_head = job->next;
          if (g_head == NULL) g_tail = NULL;
        } else {
          size_t left = g_grave_count;
          while (released < FC_RELEASE_BATCH && left > 0) graves[released++] = g_graves[--left];
          __atomic_store_n(&g_grave_count, left, __ATOMIC_RELEASE);
        }
        pthread_mutex_unlock(&g_lock);
        if (job == NULL && released == 0) return NULL;  /* (stopping) */
        break;
      }
      ++spins;
      __builtin_ia32_pause();
    }
    if (job != NULL) {
      run(job);
    } else {
      for (size_t i = 0; i < released; ++i) TVMFFIObjectDecRef(graves[i]);
    }
  }
}

/* Start the worker; 0 on success. */
int fc_start(void) {
  pthread_mutex_lock(&g_lock);
  int rc = 0;
  if (!g_running) {
    if (g_make_array == NULL) {
      TVMFFIByteArray name = {"ffi.Array", 9};
      if (TVMFFIFunctionGetGlobal(&name, &g_make_array) != 0 || g_make_array == NULL) rc = -1;
    }
    if (rc == 0) {
      g_stop = 0;
      rc = pthread_create(&g_thread, NULL, worker, NULL);
      g_running = rc == 0;
    }
  }
  pthread_mutex_unlock(&g_lock);
  return rc;
}

/* Stop the worker once its queue is done (at exit). */
void fc_stop(void) {
  pthread_mutex_lock(&g_lock);
  int running = g_running;
  g_stop = 1;
  pthread_cond_signal(&g_wake);
  pthread_mutex_unlock(&g_lock);
  if (running) pthread_join(g_thread, NULL);
  g_running = 0;
}

int fc_job_size(void) { return (int)sizeof(fc_job); }

/* Queue a job (its fields set by the caller, state FC_QUEUED). */
void fc_submit(fc_job *job) {
  job->next = NULL;
  __atomic_store_n(&job->state, FC_QUEUED, __ATOMIC_RELEASE);
  pthread_mutex_lock(&g_lock);
  if (g_tail != NULL) {
    g_tail->next = job;
  } else {
    __atomic_store_n(&g_head, job, __ATOMIC_RELEASE);
  }
  g_tail = job;
  if (g_sleeping) pthread_cond_signal(&g_wake);
  pthread_mutex_unlock(&g_lock);
}

/* Take a reference to a tvm-ffi object for the worker to drop, between jobs
 * (its destructor runs there when that is the last one); 0 on success, -1 when
 * the worker cannot take it (then nothing is taken). */
int fc_defer_release(void *obj) {
  if (obj == NULL) return -1;
  pthread_mutex_lock(&g_lock);
  int rc = 0;
  if (!g_running || g_stop) {
    rc = -1;
  } else if (g_grave_count == g_grave_cap) {
    size_t cap = g_grave_cap ? 2 * g_grave_cap : 1024;
    TVMFFIObjectHandle *grown = (TVMFFIObjectHandle *)realloc(g_graves, cap * sizeof(*grown));
    if (grown == NULL) {
      rc = -1;
    } else {
      g_graves = grown;
      g_grave_cap = cap;
    }
  }
  if (rc == 0) {
    TVMFFIObjectIncRef((TVMFFIObjectHandle)obj);
    g_graves[g_grave_count] = (TVMFFIObjectHandle)obj;
    __atomic_store_n(&g_grave_count, g_grave_count + 1, __ATOMIC_RELEASE);
    if (g_sleeping) pthread_cond_signal(&g_wake);
  }
  pthread_mutex_unlock(&g_lock);
  return rc;
}

/* How many references handed to fc_defer_release the worker has yet to drop. */
int64_t fc_releases_pending(void) {
  pthread_mutex_lock(&g_lock);
  int64_t n = (int64_t)g_grave_count;
  pthread_mutex_unlock(&g_lock);
  return n;
}

/* Wait (spinning) until a job has finished; its state. Called without the
 * interpreter lock, which other threads may take meanwhile. */
int fc_wait(fc_job *job) {
  long spins = 0;
  int s;
  while ((s = __atomic_load_n(&job->state, __ATOMIC_ACQUIRE)) == FC_QUEUED) relax(&spins, 32);
  return s;
}
