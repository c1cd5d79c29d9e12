"""The search for the longest sequence that fits: a secant search over fake steps, and the methods' searches in
forked processes with one progress bar."""

import multiprocessing
import os
import pickle
import signal


def search_max_fitting(peak, budget, granularity, limit, prefetch=None):
    """Largest multiple S of `granularity`, S <= `limit`, with peak(S) <= budget (peak increasing in S).

    The peak is piecewise linear in S (no S x S tensor; the LM-head chunk policy adds a kink), so a
    secant search finds the boundary in a few calls: extrapolate through the last two measured
    points until one does not fit, then interpolate between the ends of the bracket
    [fits, does not fit], with a bisection step whenever an interpolation did not halve it. An extrapolation
    goes at most 4x beyond the longest length measured.
    The answer rests only on measured values of peak, never on an extrapolated one.

    `prefetch(S)`, if given, may start measuring peak(S) meanwhile: once the bracket is known, each interpolated
    guess S comes with S + granularity, the other end of the answer when the guess is exact (the peak is linear
    between kinks), so the last two measurements run at once.
    """
    g = granularity
    limit = max(limit // g * g, g)
    if peak(g) > budget:
        return 0
    lo, hi = g, None  # lo fits; hi does not (None until one is found)
    prev, s = g, min(4 * g, limit)
    bisect_next, width = False, None
    prefetched = set()
    while True:
        if peak(s) <= budget:
            lo = max(lo, s)
        else:
            hi = s if hi is None else min(hi, s)
        if lo == limit or (hi is not None and hi - lo <= g):
            return lo
        if hi is None:  # no upper end yet: extrapolate through the two latest points
            a, b = prev, s
        else:  # interpolate between the bracket's ends
            a, b = lo, hi
            # bisect if the previous interpolation did not at least halve the bracket
            bisect_next = width is not None and not bisect_next and (hi - lo) > width // 2
            width = hi - lo
        slope = (peak(b) - peak(a)) / (b - a)
        if hi is not None and (bisect_next or slope <= 0):
            guess = (lo + hi) // 2 // g * g
        elif slope <= 0:  # flat so far: grow
            guess = 2 * lo
        else:
            guess = int(a + (budget - peak(a)) / slope) // g * g
            if hi is None:
                # At most 4x the longest length measured: at short lengths a flat stretch (the kept gradients
                # dominate the peak until the LM head's logits do) would send the secant millions of tokens out,
                # to a fake step that takes minutes.
                guess = min(guess, 4 * s)
        upper = limit if hi is None else hi - g
        prev, s = s, min(max(guess, lo + g), upper)
        # Not when s itself was prefetched: its value is there at once, and decides whether s + g is needed.
        if prefetch is not None and hi is not None and s + g < hi and s not in prefetched:
            prefetch(s + g)
            prefetched.add(s + g)


class ForkedCall:
    """`function()` run in a forked child process; `result()` waits for its return value (or raises its error).
    The child has the parent's memory as it was, so a planner measures there what it would measure here."""

    def __init__(self, function):
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: run, send the pickled outcome, leave without the parent's exit handlers
            try:
                os.close(read)
                try:
                    outcome = (True, function())
                except BaseException as err:  # noqa: BLE001 (re-raised in the parent)
                    outcome = (False, err)
                try:
                    payload = pickle.dumps(outcome)
                except Exception as err:  # noqa: BLE001 (an outcome that does not pickle: say so instead)
                    payload = pickle.dumps((False, RuntimeError(f"planner: a prefetched step's outcome {err!r}")))
                with os.fdopen(write, "wb") as pipe:
                    pipe.write(payload)
            finally:  # never back into the parent's code
                os._exit(0)
        os.close(write)
        self.read = read

    def cancel(self):
        """Stop the child (its result is no longer needed)."""
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self.read)

    def result(self):
        with os.fdopen(self.read, "rb") as pipe:
            payload = pipe.read()
        _, status = os.waitpid(self.pid, 0)
        if not payload:  # killed before it wrote (out of memory, a signal)
            raise RuntimeError(f"planner: the process measuring a prefetched step ended without a result "
                               f"(wait status {status}); run with --jobs 1 to measure in this process")
        ok, value = pickle.loads(payload)
        if not ok:
            raise value
        return value


class _QueueProgress:
    """A worker's stand-in for the tqdm bar: sends its updates to the parent, which shows them."""

    def __init__(self, events):
        self.events = events

    def set_postfix_str(self, text):
        self.events.put(("postfix", text))

    def update(self):
        self.events.put(("update", None))


_WORKER = None  # (planner, budget, granularity, events): set before forking, read by the workers


def _search_worker(method):
    planner, budget, granularity, events = _WORKER
    planner.progress = _QueueProgress(events)
    planner.max_seq_len(method, budget, granularity)
    return ({k: v for k, v in planner._peaks.items() if k[0] == method},
            {k: v for k, v in planner._host.items() if k[0] == method})


# The methods by how long their search takes (llama3-8b: about 61, 21, 7, 6, 2 and 1 s in one process).
SLOWEST_SEARCHES_FIRST = ("mini_sequence+streaming", "mini_sequence+checkpointing", "mini_sequence", "streaming",
                          "checkpointing", "vanilla")


def search_in_processes(planner, methods, budget, granularity, jobs):
    """Each method's search in a forked worker; their fake steps' peaks come back into `planner`'s memo,
    so `_measure` then reads every answer without another step."""
    global _WORKER
    context = multiprocessing.get_context("fork")
    events = context.SimpleQueue()
    bar, _WORKER = planner.progress, (planner, budget, granularity, events)
    try:
        with context.Pool(min(jobs, len(methods))) as pool:
            # The longest searches first, one method per task: the others fill the remaining workers meanwhile.
            longest_first = sorted(methods, key=lambda m: SLOWEST_SEARCHES_FIRST.index(m))
            pending = pool.map_async(_search_worker, longest_first, chunksize=1)
            while not (pending.ready() and events.empty()):
                if events.empty():
                    pending.wait(0.2)
                    continue
                kind, text = events.get()
                if kind == "postfix":
                    bar.set_postfix_str(text)
                else:
                    bar.update()
            for peaks, host in pending.get():
                planner._peaks.update(peaks)
                planner._host.update(host)
    finally:
        _WORKER = None
