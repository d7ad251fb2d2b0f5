"""One pipeline stage: forward and backward of microbatches, holding what backward needs until then."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .loss import HeadLoss, loss_sum
from .models.decoder import DecoderParts

# The autograd node of torch.utils.checkpoint(..., use_reentrant=True), which only a plain backward can run.
_REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"


# In one process, a layer under reentrant checkpointing whose input does not require grad (after a frozen embedding)
# gives no gradient, nor does any layer after it; the next stage, whose input requires grad, would train its own.
_GRAPH_CUT = (
    "the output of stage {stage} does not require grad although its layers hold parameters that do: its forward cut "
    "the autograd graph, as activation checkpointing with use_reentrant=True does for a layer whose input does not "
    "require grad (after a frozen embedding). In one process no later layer would get a gradient either, while the "
    "next stage would train its own; call model.enable_input_require_grads() (transformers 4 does so only for PEFT "
    "models), or checkpoint with use_reentrant=False")


class PipelineStage:
    """Runs `parts` on microbatches; the last stage also computes the scaled loss, and when no hook
    watches its head, runs the head's backward by hand (`loss.HeadLoss`).

    `forward` keeps the microbatch's input and output (the autograd graph between them) until
    `backward` consumes them, so peak memory is set by how many microbatches a schedule keeps
    in flight; with `recompute`, only the input, and the backward runs the forward again first.
    Inputs that arrive from another stage become leaves that require grad, so a backward can
    return the gradient the previous stage needs.
    """

    def __init__(self, parts: DecoderParts, stage_idx: int, num_stages: int, autocast_dtype=None,
                 recompute: bool = False):
        self.parts = parts
        self.stage_idx = stage_idx
        self.num_stages = num_stages
        self.is_first = stage_idx == 0
        self.is_last = stage_idx == num_stages - 1
        self.autocast_dtype = autocast_dtype
        self.recompute = recompute
        self._saved: dict[int, _Saved | _Replay] = {}
        self._pending_weights: dict[int, tuple[_WeightPass, HeadLoss | None]] = {}  # I done, W not yet

    def forward(self, mb: int, x: torch.Tensor, labels=None, loss_scale: float = 1.0, training: bool = True,
                backward_next: bool = False):
        """Forward microbatch `mb`; returns the output to hand on (the detached loss on the last stage).

        With `training=False` no graph is built or kept (evaluation). With `recompute`, a training
        forward whose backward is not this stage's next action (`backward_next`) keeps no graph
        either, only what it takes to run again, with one, right before its backward (`_Replay`).
        """
        graph = training and (backward_next or not self.recompute)
        replay = _Replay(x, labels, loss_scale, _RandomState.of(x.device)) if training and not graph else None
        out, saved = self._forward(x, labels, loss_scale, training, graph)
        if training:
            self._saved[mb] = saved if graph else replay
        return out

    def _forward(self, x: torch.Tensor, labels, loss_scale: float, training: bool, graph: bool
                 ) -> tuple[torch.Tensor, _Saved | None]:
        """The forward's output to hand on, and with `graph` what its backward needs. `training` picks the head's
        path as a training step does, so a forward run again for its graph (`graph`) computes what it did."""
        if not self.is_first and graph:
            x = x.detach().requires_grad_()
        # Entered after set_grad_enabled, so an evaluation (no grad) leaves the embedding as it is.
        seen = _ForwardSeen()  # what a split backward must know of this forward
        with self._autocast(x), torch.set_grad_enabled(graph), sparse_embedding_grad(self.parts.embed_tokens), \
                _forward_watched(seen, graph), _input_changed_in_place_told(not self.is_first):
            if self.is_last and head_loss_applies(self.parts.lm_head, training):
                hidden = self.parts.forward(x, head=False)
                head = HeadLoss(hidden, self.parts.lm_head, labels, loss_scale, self.parts.scales, need_grad=graph)
                return head.loss, _Saved(x, hidden, seen, head) if graph else None
            out = self.parts.forward(x)
            if self.is_last:
                out = loss_sum(out, labels) * loss_scale
        if graph and not self.is_last and not out.requires_grad and self._layers_train():
            raise ValueError(_GRAPH_CUT.format(stage=self.stage_idx))
        return out.detach(), _Saved(x, out, seen) if graph else None

    def _layers_train(self) -> bool:
        return any(p.requires_grad for _, layer in self.parts.layers for p in layer.parameters())

    def _take_saved(self, mb: int) -> _Saved:
        """What microbatch `mb`'s backward needs; a forward that kept no graph runs again, as it ran, to make it."""
        saved = self._saved.pop(mb)
        if isinstance(saved, _Replay):
            with saved.random_state.restored():
                _, saved = self._forward(saved.x, saved.labels, saved.loss_scale, training=True, graph=True)
        return saved

    def backward(self, mb: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Backward microbatch `mb`: accumulates weight grads, returns the input's grad (None on stage 0)."""
        saved = self._take_saved(mb)
        if saved.out.requires_grad:  # not so on a first stage whose parameters are all frozen
            torch.autograd.backward(saved.out, saved.grad_output(grad_output))
        if saved.head is not None:
            saved.head.add_weight_grad()
        return None if self.is_first else saved.x.grad

    def backward_input(self, mb: int, grad_output: torch.Tensor | None) -> torch.Tensor:
        """The input's grad of microbatch `mb` alone, so it can be sent before the weight grads are made.

        Keeps the graph and the gradients reaching each parameter's use, for `backward_weight`.
        """
        if self.is_first:
            raise ValueError("the first stage has no input gradient to send; its schedule runs B, not I and W")
        saved = self._take_saved(mb)
        weight_pass = _WeightPass(self.parts.parameters())
        self._pending_weights[mb] = (weight_pass, saved.head)
        return weight_pass.input_grad(saved.out, saved.x, saved.grad_output(grad_output), saved.seen)

    def backward_weight(self, mb: int) -> None:
        """Accumulate the weight grads of microbatch `mb`, whose `backward_input` has run."""
        weight_pass, head = self._pending_weights.pop(mb)
        weight_pass.run()
        if head is not None:
            head.add_weight_grad()

    @property
    def num_saved(self) -> int:
        """Microbatches whose activations are held for backward (or for their weight grads)."""
        return len(self._saved) + len(self._pending_weights)

    def clear(self) -> None:
        """Drop saved activations (after an aborted step)."""
        self._saved.clear()
        self._pending_weights.clear()

    def _autocast(self, x: torch.Tensor):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(x.device.type, dtype=self.autocast_dtype)


@dataclass
class _Saved:
    """What a microbatch's backward needs: its input and output, and on a last stage that stopped
    autograd before its head, the head's loss (`HeadLoss`), which makes the output's gradient."""

    x: torch.Tensor
    out: torch.Tensor
    seen: _ForwardSeen
    head: HeadLoss | None = None

    def grad_output(self, received: torch.Tensor | None) -> torch.Tensor | None:
        """The gradient to start the backward from: the head's, else the one received."""
        return received if self.head is None else self.head.input_grad()


@dataclass
class _Replay:
    """What a forward run without a graph keeps to run again with one (`PipelineStage.recompute`): its input,
    labels and loss scale, and the random state it started from, so that dropout draws alike."""

    x: torch.Tensor
    labels: torch.Tensor | None
    loss_scale: float
    random_state: _RandomState


@dataclass
class _RandomState:
    """The CPU's random state and, on a GPU, the device's: what dropout draws from."""

    cpu: torch.Tensor
    device: torch.device
    accelerator: torch.Tensor | None

    @classmethod
    def of(cls, device: torch.device) -> _RandomState:
        accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), device, accelerator)

    @contextlib.contextmanager
    def restored(self):
        """Within: this random state; afterwards, the one from before (the step's later draws go on as they would)."""
        with torch.random.fork_rng(devices=[self.device] if self.accelerator is not None else []):
            torch.set_rng_state(self.cpu)
            if self.accelerator is not None:
                torch.cuda.set_rng_state(self.accelerator, self.device)
            yield


def inference_mode_error() -> str | None:
    """Why no training step can run here, or None: inside torch.inference_mode() no graph is built,
    and `torch.set_grad_enabled(True)` cannot turn it back on."""
    if torch.is_inference_mode_enabled():
        return ("a training step cannot run inside torch.inference_mode(), where no backward can follow a forward; "
                "call it outside (Pipeline.evaluate computes a loss without a graph)")
    return None


@dataclass
class _ForwardSeen:
    """What a forward did that a split backward must know and the graph does not show (`_WeightPass`)."""

    hooked: set = field(default_factory=set)  # nodes of tensors given a gradient hook or retain_grad()
    # Saved tensors went through hooks (non-reentrant activation checkpointing, offloading), which run
    # again in every backward call: a checkpointed layer would recompute its forward for each weight group.
    saved_tensor_hooks: bool = False


@contextlib.contextmanager
def _forward_watched(seen: _ForwardSeen, enabled: bool):
    """Within: the autograd node of every tensor given a gradient hook (`register_hook`) or
    `retain_grad()` is added to `seen.hooked`, and saved-tensor hooks in use (entered within, as
    non-reentrant checkpointing does, or already around) set `seen.saved_tensor_hooks`. Sees what the
    forward does (a module's forward hook, a layer's own code) by wrapping the `torch.Tensor` and
    `saved_tensors_hooks` methods until the end."""
    if not enabled:
        yield
        return
    seen.saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    names = ("register_hook", "retain_grad")
    own = {name: torch.Tensor.__dict__.get(name) for name in names}  # retain_grad is TensorBase's
    inherited = {name: getattr(torch.Tensor, name) for name in names}
    enter = torch.autograd.graph.saved_tensors_hooks.__enter__

    def recording(name):
        def method(tensor, *args, **kwargs):
            if tensor.grad_fn is not None:
                seen.hooked.add(tensor.grad_fn)
            return inherited[name](tensor, *args, **kwargs)
        return method

    def entering(hooks):
        seen.saved_tensor_hooks = True
        return enter(hooks)

    for name in names:
        setattr(torch.Tensor, name, recording(name))
    torch.autograd.graph.saved_tensors_hooks.__enter__ = entering
    try:
        yield
    finally:
        torch.autograd.graph.saved_tensors_hooks.__enter__ = enter
        for name in names:
            if own[name] is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own[name])


@contextlib.contextmanager
def _input_changed_in_place_told(received: bool):
    """Within: autograd's refusal of an in-place change to a leaf says why it meets a stage's input, which (`received`
    from the stage before) is a leaf where in one process it is not: a hook that changes a layer's input in place."""
    try:
        yield
    except RuntimeError as e:
        if received and "leaf Variable that requires grad is being used in an in-place operation" in str(e):
            e.add_note("pipeline_parallel: a stage's input, received from the stage before, is a leaf of the stage's "
                       "graph: a hook (or module) that changes it in place, as a forward pre-hook doing args[0].add_(...) "
                       "would, must return a changed copy instead (return (args[0] + v, *args[1:]))")
        raise


@contextlib.contextmanager
def sparse_embedding_grad(embedding: torch.nn.Module | None):
    """Within: `embedding` makes a sparse gradient of the rows it looked up, added into a dense `.grad`.

    A dense embedding backward makes a vocab x hidden gradient for every microbatch and adds it
    into `.grad`: on the first stage that costs more than its embedding lookups (a 128k x 4096
    vocabulary: a gigabyte per microbatch). A sparse one holds only the looked-up rows, and
    autograd adds it into a dense `.grad` in place, so the step makes one dense gradient, not one
    per microbatch; `.grad` is made here if missing, so it stays dense. Values equal the dense
    backward's up to the order of the sum over repeated tokens. Skipped, leaving the embedding as
    it is, where someone would see the sparse gradient (a hook on the weight, a weight that is no
    plain Parameter), where torch has no sparse backward (`scale_grad_by_freq`) or where it would change
    nothing (no gradient, already sparse).
    """
    weight = getattr(embedding, "weight", None)
    if (not isinstance(embedding, torch.nn.Embedding) or embedding.sparse or embedding.scale_grad_by_freq
            or not _unwatched_trainable(weight) or not torch.is_grad_enabled()):
        yield
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    embedding.sparse = True
    try:
        yield
    finally:
        embedding.sparse = False


def head_loss_applies(head: torch.nn.Module, training: bool = True) -> bool:
    """Whether `HeadLoss` may stand in for calling `head` (and, in training, autograd): a plain
    Linear without bias whose call no hook watches and, in training, whose trainable weight and
    gradient none watches either (a hook would miss the call, or the gradient bypassing autograd's
    accumulation)."""
    from torch.nn.modules import module as hooks

    call_unwatched = (type(head) is torch.nn.Linear and head.bias is None
                      and not (head._forward_pre_hooks or head._forward_hooks
                               or hooks._global_forward_pre_hooks or hooks._global_forward_hooks))
    if not (call_unwatched and training):
        return call_unwatched
    weight = head.weight
    return (_unwatched_trainable(weight)
            and (weight.grad is None or weight.grad.layout == torch.strided)
            and not weight._post_accumulate_grad_hooks
            and not (head._backward_pre_hooks or head._backward_hooks)
            and not (hooks._global_backward_pre_hooks or hooks._global_backward_hooks))


def _unwatched_trainable(weight) -> bool:
    """A plain trainable Parameter with no hook on its gradient: one whose gradient the stage may
    make another way than autograd would (a hook would be handed, or miss, what it makes)."""
    return type(weight) is torch.nn.Parameter and weight.requires_grad and not weight._backward_hooks


class _WeightPass:
    """Splits one backward into the input's gradient now and the weight gradients later.

    The autograd nodes that use a parameter together with activations (a matmul taking a
    weight, a norm's scale) are found by walking the graph. While the input's gradient is
    computed, a hook keeps the gradient arriving at each such node; `run` later starts autograd
    from those nodes towards their parameters only, one group of nodes and parameters at a time,
    so no activation gradient is computed twice. The first pass is simply the full backward, and
    the second has nothing to do, if the output does not depend on the input, if the graph holds
    reentrant activation checkpointing (which autograd cannot run for chosen inputs only), or if
    a parameter is used twice along one path (a weight shared by two layers of the stage): from
    its later use, autograd would run the activation gradients back to the earlier one again,
    and their hooks with them. Uses side by side, such as the experts of a fused MoE weight, split.
    Nor is it split where a tensor's gradient hook (or `retain_grad`) sits on a node where a parameter
    meets the activations (a hook on a norm's output): autograd runs it when the node runs, so it
    would run again, on what it already changed, when the weight pass restarts autograd there; nor
    where saved tensors went through hooks, which every backward call runs again (non-reentrant
    checkpointing would recompute a layer's forward, and fire its hooks, once per weight group; its
    `GraphExecGroup`, which recomputes once, refuses two backward calls that unpack the same saved
    activation, as both passes do at a node where a weight meets the activations).
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.kept: dict = {}  # node using a parameter -> gradients arriving at it (filled by input_grad)
        self.groups: list[tuple[set, list]] = []  # nodes, and the gradient edges of the parameters they reach

    def input_grad(self, out: torch.Tensor, x: torch.Tensor, grad_output: torch.Tensor | None,
                   seen: _ForwardSeen | None = None) -> torch.Tensor:
        """The gradient of `x`, keeping what `run` needs to make the parameters' gradients later;
        `seen` is what the forward did beyond the graph (`_forward_watched`)."""
        seen = seen or _ForwardSeen()
        self.groups = [] if seen.saved_tensor_hooks else _weight_groups(out, x, self.params)
        if any(nodes & seen.hooked for nodes, _ in self.groups):
            self.groups = []
        if not self.groups:
            torch.autograd.backward(out, grad_output)
            return x.grad
        self.kept = {node: None for nodes, _ in self.groups for node in nodes}

        def keep(node):
            def hook(grad_outputs):
                self.kept[node] = grad_outputs
            return hook

        handles = [node.register_prehook(keep(node)) for node in self.kept]
        try:
            (grad_input,) = torch.autograd.grad(out, x, grad_output, retain_graph=True)
        finally:
            for handle in handles:
                handle.remove()
        return grad_input

    def run(self) -> None:
        for nodes, param_edges in self.groups:
            edges, grads = [], []
            for node in nodes:
                for index, grad in enumerate(self.kept[node] or ()):
                    if grad is not None:
                        edges.append(torch.autograd.graph.GradientEdge(node, index))
                        grads.append(grad)
            if not edges:
                continue  # no gradient reached these parameters
            # Through the parameters' own accumulators: .grad adds up and their hooks fire as usual. No
            # node of the group leads to another, so each parameter gets each use's gradient once.
            torch.autograd.backward(edges, grads, retain_graph=True, inputs=param_edges)
        self.kept, self.groups = {}, []


def _weight_groups(out: torch.Tensor, x: torch.Tensor, params: list[torch.nn.Parameter]) -> list[tuple[set, list]]:
    """The nodes where parameters meet the activations between `x` and `out`, grouped so that no
    group shares a node with another, each with its parameters' gradient edges; [] if the backward
    cannot be split (see `_WeightPass`)."""
    consumers = _consumers(out.grad_fn)
    x_node = torch.autograd.graph.get_gradient_edge(x).node
    on_x_path = _reachable([x_node], consumers)
    if out.grad_fn not in on_x_path or any(node.name() == _REENTRANT_CHECKPOINT for node in consumers):
        return []
    groups: list[tuple[set, list]] = []
    for param in params:
        edge = torch.autograd.graph.get_gradient_edge(param) if param.requires_grad else None
        if edge is None or edge.node not in consumers:
            continue  # not used for this output
        nodes, group = _reachable([edge.node], consumers, stop=on_x_path), [edge]
        # Parameters that share a node (a weight and its bias, or one weight used twice) go together.
        for other in [g for g in groups if g[0] & nodes]:
            groups.remove(other)
            nodes, group = nodes | other[0], group + other[1]
        groups.append((nodes, group))
    if any(_one_reaches_another(nodes, consumers) for nodes, _ in groups):
        return []
    return groups


def _consumers(root) -> dict:
    """For every autograd node under `root`, the nodes that take its output (edges reversed)."""
    consumers = {root: []}
    stack = [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in consumers:
                consumers[child] = []
                stack.append(child)
            consumers[child].append(node)
    return consumers


def _one_reaches_another(nodes: set, consumers: dict) -> bool:
    """Whether the output of one of `nodes` flows into another of them (one weight used twice in a row)."""
    stack, seen = [c for node in nodes for c in consumers.get(node, ())], set()
    while stack:
        node = stack.pop()
        if node in nodes:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(consumers.get(node, ()))
    return False


def _reachable(starts: list, consumers: dict, stop: set | None = None) -> set:
    """Nodes reached from `starts` along consumer edges. With `stop`, the nodes of `stop` reached
    first (the walk does not go past them), which is how a parameter finds where it meets the activations."""
    seen, found, stack = set(starts), set(), list(starts)
    while stack:
        for consumer in consumers.get(stack.pop(), ()):
            if consumer in seen:
                continue
            seen.add(consumer)
            if stop is not None and consumer in stop:
                found.add(consumer)
            else:
                stack.append(consumer)
    return found if stop is not None else seen
