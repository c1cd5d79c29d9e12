"""A deep decoder stack's step peak from a shallower stack of the same layers (the planner's speed-up).

One training step of a decoder stack goes through phases, in this order:

    prologue      embedding, masks, rotary tables
    forward i     decoder layer i's forward, i = 0 .. L-1
    head          final norm, LM head, loss, and their backward
    backward i    from the gradient of layer i's output to that of its input, i = L-1 .. 0
    tail          the embedding's backward and whatever follows

A phase of a given layer kind allocates and frees the same tensors at any depth, so it changes the live bytes by
the same amount (`change`) and rises the same height above where it began (`rise`). The step peak is the highest
`start + rise` along the sequence, each phase starting where the previous one ended. A stack of L layers whose
kinds repeat with period p therefore has the peak of the sequence of a shallower stack of L - k*p layers with k
more copies of one period block of forward phases and one of backward phases: the planner measures the shallow
stack and walks the deep sequence, which gives the same bytes as running all L layers (`tests/test_plan.py`
compares the two) at a fraction of the cost. The shallow stack keeps the first and last period blocks as they
are (boundary effects: the embedding's output, the final norm's input) and two middle blocks, which must be
equal phase for phase; when they are not, or the stack is too shallow to gain anything, the planner runs every
layer. Once a method's two middle blocks were equal at one length, its later steps run one middle block (the layers
of a kind run the same code whatever the length; the tests compare those steps with every layer too).

Host memory (offloaded layer inputs) is walked the same way, from its own `rise` and `change` per phase.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    key: tuple  # ("prologue",), ("forward", i), ("head",), ("backward", i) or ("tail",)
    rise: int  # highest live bytes during the phase, minus those when it began
    change: int  # live bytes when it ended, minus those when it began
    host_rise: int
    host_change: int

    def same_work(self, other):
        return (self.rise, self.change, self.host_rise, self.host_change) == (
            other.rise, other.change, other.host_rise, other.host_change)


class PhaseRecorder:
    """Cuts one step into phases (module docstring) with hooks on the decoder layers and the final norm.

    `tracker` is a running `LiveTensorTracker` (its `window_peak` marks each phase's top); `host` has
    `host_bytes` and `host_window_peak` (the planner's per-rank hooks). Each hooked module counts only its first
    call of the step, made by the stack's forward: later calls (a checkpoint's recompute, a mini-sequence
    chunk) happen inside a phase already begun."""

    def __init__(self, tracker, host, layers, final_norm):
        self.tracker, self.host = tracker, host
        self.phases = []
        self._key, self._start, self._host_start = ("prologue",), tracker.current_bytes, host.host_bytes
        tracker.window_peak = tracker.current_bytes
        host.host_window_peak = host.host_bytes
        self._seen = set()
        self._handles = []
        last = len(layers) - 1
        for index, layer in enumerate(layers):
            # Layer i's input gradient ends its backward: layer i-1's begins (the tail after layer 0).
            after = ("backward", index - 1) if index else ("tail",)
            self._handles.append(layer.register_forward_pre_hook(self._on_input(("forward", index), after),
                                                                 with_kwargs=True))
        self._handles.append(final_norm.register_forward_pre_hook(self._on_input(("head",), ("backward", last)),
                                                                  with_kwargs=True))

    def _on_input(self, key, after_gradient):
        def hook(module, args, kwargs):
            if key in self._seen:
                return
            self._seen.add(key)
            self.enter(key)
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.requires_grad:
                hidden.register_hook(lambda grad: self.enter(after_gradient))

        return hook

    def enter(self, key):
        """End the running phase and begin `key`'s."""
        tracker, host = self.tracker, self.host
        self.phases.append(Phase(self._key, tracker.window_peak - self._start, tracker.current_bytes - self._start,
                                 host.host_window_peak - self._host_start, host.host_bytes - self._host_start))
        self._key, self._start, self._host_start = key, tracker.current_bytes, host.host_bytes
        tracker.window_peak = tracker.current_bytes
        host.host_window_peak = host.host_bytes

    def finish(self):
        """End the last phase and remove the hooks; returns the phases."""
        self.enter(None)
        for handle in self._handles:
            handle.remove()
        return self.phases


def walk(phases):
    """(peak live bytes, peak host bytes) of a phase sequence starting from nothing live."""
    live = host = peak = host_peak = 0
    for phase in phases:
        peak, host_peak = max(peak, live + phase.rise), max(host_peak, host + phase.host_rise)
        live, host = live + phase.change, host + phase.host_change
    return peak, host_peak


def deepened(phases, period, extra_blocks, check=True):
    """The phase sequence of the stack with `extra_blocks` more copies of its first middle block (layers p..2p-1),
    or None when `check` and the shallow stack's two middle blocks (layers p..2p-1 and 2p..3p-1, forward and
    backward) do not do the same work."""
    position = {phase.key: n for n, phase in enumerate(phases)}

    def block(kind, first):
        return [phases[position[(kind, i)]] for i in range(first, first + period)]

    for kind in ("forward", "backward") if check else ():
        a, b = block(kind, period), block(kind, 2 * period)
        if not all(x.same_work(y) for x, y in zip(a, b)):
            return None
    forward_end = position[("forward", 2 * period - 1)] + 1  # insert after the first middle forward block
    backward_end = position[("backward", period)] + 1  # the backward runs layers downwards: after layer p's
    forward_block = phases[position[("forward", period)]:forward_end]
    backward_block = phases[position[("backward", 2 * period - 1)]:backward_end]
    return (phases[:forward_end] + forward_block * extra_blocks + phases[forward_end:backward_end]
            + backward_block * extra_blocks + phases[backward_end:])


def layer_period(signatures):
    """Smallest p such that layer i and layer i + p are built alike for every i (len(signatures) if none)."""
    count = len(signatures)
    for period in range(1, count):
        if all(signatures[i] == signatures[i + period] for i in range(count - period)):
            return period
    return count


def shallow_depth(depth, period, middle_blocks=2):
    """Layers of the shallow stack to measure: the first block, `middle_blocks` middle blocks, the last block and
    the remainder that makes its depth congruent to `depth` modulo `period`; None when that is not shallower."""
    shallow = (2 + middle_blocks) * period + depth % period
    return shallow if shallow < depth else None
